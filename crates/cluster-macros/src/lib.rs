//! `#[entity]`: an entity of `cluster-sharding` from one impl block.
//!
//! Applications use it through `cluster_sharding::entity` (the default feature `macros` of
//! `cluster-sharding` re-exports it); this crate has nothing else. See [`macro@entity`] for
//! what it generates and every argument it takes, and `docs/sharding.md` for the guide.

mod expand;
mod parse;
#[cfg(test)]
mod tests;

/// Writes an entity's request implementations, handlers, protocol and typed client from the
/// inherent impl block of the entity type.
///
/// ```
/// use cluster_core::ShardingConfig;
/// use cluster_sharding::{EntityOptions, Never, RequestContext, Sharding, entity};
/// use serde::{Deserialize, Serialize};
///
/// /// Adds `amount`; `key` makes it one deposit however often it is sent.
/// #[derive(Serialize, Deserialize)]
/// struct Deposit {
///     key: String,
///     amount: u64,
/// }
///
/// /// A bank account per entity id.
/// struct Account {
///     balance: u64,
/// }
///
/// #[entity]
/// impl Account {
///     async fn create() -> Self {
///         Account { balance: 0 }
///     }
///
///     /// Adds the deposit to the balance.
///     #[rpc(persisted, primary_key = key)]
///     async fn deposit(&mut self, _: &RequestContext, deposit: Deposit) -> Result<u64, Never> {
///         self.balance += deposit.amount;
///         Ok(self.balance)
///     }
///
///     /// Reads the balance. It takes no request: `Balance` is generated.
///     #[rpc]
///     async fn balance(&self) -> Result<u64, Never> {
///         Ok(self.balance)
///     }
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let sharding = Sharding::volatile(ShardingConfig::default()).start().await?;
/// sharding.entity::<Account>().register()?;
/// let accounts = Account::client(&sharding);
/// assert_eq!(accounts.balance("alice").await?, 0);
/// # sharding.shutdown().await;
/// # Ok(())
/// # }
/// ```
///
/// # What it generates
///
/// - The impl block itself, as written: its methods stay callable.
/// - For each `#[rpc]` method that takes no request, its request type: a unit struct named
///   after the method (`last_seen` makes `LastSeen`), with serde's traits, visible as the typed
///   client is. It is stored as `null`, as a hand-written unit struct is.
/// - For each `#[rpc]` method, `impl Rpc for Request` (or `StreamRpc` for a stream): the tag,
///   the flags of the method's arguments, `Success` and `Error` from its
///   `Result<Success, Error>`.
/// - For each `#[rpc]` method, the handler: `Handler<Request>` for `&mut self` (requests run
///   one at a time), `SharedHandler<Request>` for `&self` (they run side by side, up to
///   `EntityOptions::concurrency`), `StreamHandler<Request>` for a stream. It calls the method.
/// - `impl Entity`: `TYPE`, `create` (or `FACTORY_ONLY` without one), and a `protocol` that
///   declares every `#[rpc]` method, so no handler is left undeclared.
/// - The typed client `<Type>Client`, made by `<Type>::client(&sharding)`: one `async` method
///   per `#[rpc]`, named after it, taking the entity id and the request (none for a generated
///   one), returning
///   `Result<Success, CallError<Error>>` (a `ChunkStream` for a stream). It also has
///   `discard(id, request)` (send without waiting for the reply) and `entity(id)` (the
///   `EntityClient` of one entity, for headers).
///
/// # `#[entity(..)]` arguments
///
/// All optional.
///
/// | Argument | Meaning |
/// |---|---|
/// | `name = "Account"` | The entity type's name (`Entity::TYPE`), stored with every message. The type's name by default. |
/// | `crate = path` | Where the runtime is: `::cluster_sharding` by default. A crate that re-exports `cluster-sharding` whole (`pub use cluster_sharding::*`) passes its own path, such as `crate = durable_cluster`. |
/// | `client = pub AccountClient` | The typed client's visibility and name. Private and `<Type>Client` by default; the `client` constructor gets the same visibility. |
/// | `client_tracing = false` | Sets `Entity::CLIENT_TRACING`: no `entity_client` span per call. |
/// | `state = balance` | The entity's durable state (`Protocol::durable`): the field `balance`, kept in storage across restarts, moves and crashes, and committed with each request that changes it. `state = self` makes the whole value the state. The field's type implements serde's `Serialize` and `Deserialize`. |
///
/// # `#[rpc(..)]` arguments
///
/// | Argument | Meaning |
/// |---|---|
/// | `persisted` | `Rpc::PERSISTED`: saved before it runs, delivered at least once, answered once. |
/// | `primary_key = key` | `Rpc::primary_key`: the field `key` (a `String` or `Option<String>`), or a function of the request, such as `\|d: &Deposit\| d.key.clone()`. Needs `persisted`. |
/// | `deliver_at = at` | `Rpc::deliver_at`: a field or function giving a `Timestamp` or `Option<Timestamp>`. Needs `persisted`. |
/// | `uninterruptible` | `Rpc::UNINTERRUPTIBLE` = `Both`; `uninterruptible = "client"`, `"server"` or `"both"` for one side. |
/// | `interrupt_on_termination` | `Rpc::INTERRUPT_ON_TERMINATION`. |
/// | `with_transaction` | `Rpc::WITH_TRANSACTION`: the handler runs in the storage transaction that saves its reply. `with_transaction = field_or_function` (a `bool`) decides per request (`Rpc::WITH_TRANSACTION_PER_REQUEST`). Needs `persisted`. |
/// | `stream` | A streaming request (`StreamRpc`): the method takes `chunks: &mut Chunks<'_, Item>` last and returns `Result<(), Error>`. Takes only `tag`, `persisted` and `primary_key`. |
/// | `tag = "Deposit"` | The request's tag (`Rpc::TAG`). The request type's name by default. |
///
/// # Methods
///
/// An `#[rpc]` method is `async fn` or `fn`, takes `&mut self` or `&self`, optionally the
/// `&RequestContext`, then the request by value (and the `chunks` of a stream), and returns
/// `Result<Success, Error>` spelled out (`Never` for a request that cannot fail). The request
/// type must be a type of the same crate, as its `Rpc` implementation is written here; one
/// method per request type.
///
/// A unary method may take no request (`async fn balance(&self) -> Result<u64, Never>`, or
/// with the context only): its request type is generated, named after the method.
/// Its client method then takes the entity id alone (`accounts.balance("alice")`).
///
/// Methods with these names are the entity's hooks (the others are left alone):
///
/// | Method | Meaning |
/// |---|---|
/// | `[async] fn create([context: &EntityContext]) -> Self` | `Entity::create`. Optional: without it, the entity type can only be registered with a factory (`.factory(..)` or `.factory_async(..)` on `Sharding::entity`), and a registration without one fails to build (`Entity::FACTORY_ONLY`). |
/// | `[async] fn on_stop(&mut self)` | `Entity::on_stop`. |
/// | `fn shard_group(entity_id: &str) -> ShardGroup` | `Entity::shard_group`. |
/// | `fn protocol(protocol: &mut Protocol<Self>)` | Declarations of its own, after the `#[rpc]` ones: forked handlers, or handlers written by hand. |
///
/// Forked handlers (`Rpc.fork`) and generic entity types are written by hand, as without the
/// macro; both forms mix through the `protocol` hook.
///
/// # Errors
///
/// A mistake in the input is a compile error on the tokens at fault, such as a request taken
/// by reference, a return type that is not `Result<_, _>`, `primary_key` without
/// `persisted`, or two methods for one request type or tag.
#[proc_macro_attribute]
pub fn entity(
    attr: proc_macro::TokenStream,
    item: proc_macro::TokenStream,
) -> proc_macro::TokenStream {
    entity_tokens(attr.into(), item.into(), &syn::parse_quote!(::cluster_sharding)).into()
}

/// [`macro@entity`] for users of the `durable-cluster` facade, which re-exports it as
/// `durable_cluster::entity`: the runtime's path is `::durable_cluster` unless `crate = ..`
/// says otherwise.
#[proc_macro_attribute]
pub fn durable_entity(
    attr: proc_macro::TokenStream,
    item: proc_macro::TokenStream,
) -> proc_macro::TokenStream {
    entity_tokens(attr.into(), item.into(), &syn::parse_quote!(::durable_cluster)).into()
}

/// [`macro@entity`] on `proc_macro2` tokens: the expansion, or the errors followed by the
/// impl block without its `#[rpc]` attributes (so that the methods still exist and the
/// compiler reports the errors alone, not their consequences too).
fn entity_tokens(
    attr: proc_macro2::TokenStream,
    item: proc_macro2::TokenStream,
    default_crate: &syn::Path,
) -> proc_macro2::TokenStream {
    match parse::EntityDef::parse(attr, item.clone()) {
        Ok(def) => expand::expand(&def, default_crate),
        Err(error) => {
            let mut tokens = error.to_compile_error();
            tokens.extend(parse::without_rpc_attributes(item));
            tokens
        }
    }
}

/// Programs that must not build, each for the reason its comment gives; `rustdoc` checks that
/// they fail (`cargo test --doc -p cluster-macros`).
///
/// A registration without a factory of an entity type without `create`:
///
/// ```compile_fail,E0080
/// use cluster_sharding::{EntityOptions, Never, Sharding, entity};
///
/// #[derive(serde::Serialize, serde::Deserialize)]
/// struct Ping;
///
/// struct Pinger;
///
/// #[entity]
/// impl Pinger {
///     #[rpc]
///     async fn ping(&mut self, _: Ping) -> Result<(), Never> {
///         Ok(())
///     }
/// }
///
/// fn register(sharding: &Sharding) {
///     let _ = sharding.entity::<Pinger>().register();
/// }
///
/// fn main() {
///     let _: fn(&Sharding) = register;
/// }
/// ```
///
/// The same entity type registered with a factory builds (in a library crate too, which
/// compiles every non-generic function, `create` among them: `cluster-chaos`'s `Ledger` is
/// such an entity):
///
/// ```
/// use cluster_sharding::{EntityContext, EntityOptions, Never, Sharding, entity};
///
/// #[derive(serde::Serialize, serde::Deserialize)]
/// struct Ping;
///
/// struct Pinger;
///
/// #[entity]
/// impl Pinger {
///     #[rpc]
///     async fn ping(&mut self, _: Ping) -> Result<(), Never> {
///         Ok(())
///     }
/// }
///
/// fn register(sharding: &Sharding) {
///     let _ = sharding.entity().factory(|_: &EntityContext| Pinger).register();
/// }
///
/// fn main() {
///     let _: fn(&Sharding) = register;
/// }
/// ```
mod compile_fail {}
