//! Unit tests of `#[entity]` on token streams: what the expansion holds, and the error each
//! mistake gives. (The generated code running against the runtime is tested in
//! `crates/cluster-sharding/tests/it/macros.rs`.)

use proc_macro2::TokenStream;
use quote::{ToTokens, quote};
use syn::{ImplItem, Item};

use crate::entity_tokens;

/// The runtime path of `#[entity]`.
fn runtime() -> syn::Path {
    syn::parse_quote!(::cluster_sharding)
}

/// The items of an expansion that must succeed.
fn expand(attr: TokenStream, item: TokenStream) -> Vec<Item> {
    let tokens = entity_tokens(attr, item, &runtime());
    let text = tokens.to_string();
    assert!(!text.contains("compile_error"), "unexpected error: {text}");
    let file: syn::File = syn::parse2(tokens).unwrap();
    file.items
}

/// `(trait, type)` of each trait impl of `items`, as text without spaces.
fn trait_impls(items: &[Item]) -> Vec<(String, String)> {
    let text = |tokens: TokenStream| tokens.to_string().replace(' ', "");
    items
        .iter()
        .filter_map(|item| match item {
            Item::Impl(item) => item.trait_.as_ref().map(|(path, _)| {
                (text(path.to_token_stream()), text(item.self_ty.to_token_stream()))
            }),
            _ => None,
        })
        .collect()
}

/// The `Entity` impl of `items`.
fn entity_impl(items: &[Item]) -> &syn::ItemImpl {
    items
        .iter()
        .find_map(|item| match item {
            Item::Impl(item)
                if item.trait_.as_ref().is_some_and(|(path, _)| {
                    path.segments.last().is_some_and(|segment| segment.ident == "Entity")
                }) =>
            {
                Some(item)
            }
            _ => None,
        })
        .unwrap()
}

/// Asserts that `#[entity(attr)]` on `item` fails with a message containing each of
/// `expected`, and still emits the impl block without its `#[rpc]` attributes.
fn check_error(attr: TokenStream, item: TokenStream, expected: &[&str]) {
    let text = entity_tokens(attr, item, &runtime()).to_string();
    assert!(text.contains("compile_error"), "expected an error, got: {text}");
    for expected in expected {
        assert!(text.contains(expected), "expected {expected:?} in: {text}");
    }
    assert!(!text.contains("# [rpc"), "the #[rpc] attributes are left in: {text}");
}

fn account() -> TokenStream {
    quote! {
        impl Account {
            async fn create(context: &EntityContext) -> Self { Account { balance: 0 } }

            /// Adds a deposit.
            #[rpc(persisted, primary_key = key)]
            async fn deposit(&mut self, context: &RequestContext, deposit: Deposit) -> Result<u64, Never> {
                Ok(0)
            }

            #[rpc]
            async fn balance(&self, _: Balance) -> Result<u64, Never> { Ok(self.balance) }

            #[rpc(stream)]
            async fn history(&mut self, _: History, chunks: &mut Chunks<'_, u64>) -> Result<(), Never> {
                Ok(())
            }

            fn helper(&self) -> u64 { self.balance }
        }
    }
}

#[test]
fn writes_requests_handlers_entity_and_client() {
    let items = expand(quote!(), account());
    assert_eq!(
        trait_impls(&items),
        [
            ("::cluster_sharding::Rpc", "Deposit"),
            ("::cluster_sharding::Rpc", "Balance"),
            ("::cluster_sharding::StreamRpc", "History"),
            ("::cluster_sharding::Handler<Deposit>", "Account"),
            ("::cluster_sharding::SharedHandler<Balance>", "Account"),
            ("::cluster_sharding::StreamHandler<History>", "Account"),
            ("::cluster_sharding::Entity", "Account"),
        ]
        .map(|(a, b)| (a.to_owned(), b.to_owned()))
    );
    // The impl block stays, without its `#[rpc]` attributes, with its helper.
    let Item::Impl(block) = &items[0] else { panic!("the impl block comes first") };
    assert!(block.trait_.is_none());
    let methods: Vec<String> = block
        .items
        .iter()
        .filter_map(|item| match item {
            ImplItem::Fn(method) => {
                assert!(method.attrs.iter().all(|attribute| !attribute.path().is_ident("rpc")));
                Some(method.sig.ident.to_string())
            }
            _ => None,
        })
        .collect();
    assert_eq!(methods, ["create", "deposit", "balance", "history", "helper"]);
    // The protocol declares every request, each the way its receiver says.
    let protocol = entity_impl(&items).to_token_stream().to_string().replace(' ', "");
    for declaration in [
        "protocol.handle::<Deposit>();",
        "protocol.handle_shared::<Balance>();",
        "protocol.stream::<History>();",
        "constTYPE:&'staticstr=\"Account\";",
        "<Account>::create(context)",
    ] {
        assert!(protocol.contains(declaration), "{declaration} missing from {protocol}");
    }
    // The client: a struct, its constructor on the entity, its methods.
    let client = items
        .iter()
        .any(|item| matches!(item, Item::Struct(client) if client.ident == "AccountClient"));
    assert!(client, "no AccountClient");
    let client_methods: Vec<String> = items
        .iter()
        .filter_map(|item| match item {
            Item::Impl(item) if item.trait_.is_none() => Some(item),
            _ => None,
        })
        .skip(1)
        .flat_map(|item| &item.items)
        .filter_map(|item| match item {
            ImplItem::Fn(method) => Some(method.sig.ident.to_string()),
            _ => None,
        })
        .collect();
    assert_eq!(client_methods, ["client", "entity", "discard", "deposit", "balance", "history"]);
}

/// A method without a request gets a unit struct named after it, with the client's visibility;
/// its handler and client method take none.
#[test]
fn a_method_without_a_request_gets_its_request_type() {
    let items = expand(
        quote!(client = pub AccountClient),
        quote! {
            impl Account {
                #[rpc]
                async fn last_seen(&self) -> Result<u64, Never> { Ok(0) }
                #[rpc]
                fn touch(&mut self, context: &RequestContext) -> Result<(), Never> { Ok(()) }
            }
        },
    );
    let structs: Vec<String> = items
        .iter()
        .filter_map(|item| match item {
            Item::Struct(item) => Some(item.to_token_stream().to_string().replace(' ', "")),
            _ => None,
        })
        .collect();
    assert!(structs.iter().any(|item| item.ends_with("pubstructLastSeen;")), "{structs:?}");
    assert!(structs.iter().any(|item| item.ends_with("pubstructTouch;")), "{structs:?}");
    assert!(structs[0].contains("::cluster_sharding::__private::serde::Serialize"));
    let impls = trait_impls(&items);
    assert!(impls.contains(&("::cluster_sharding::Rpc".to_owned(), "LastSeen".to_owned())));
    assert!(
        impls.contains(&("::cluster_sharding::Handler<Touch>".to_owned(), "Account".to_owned()))
    );
    let text = quote!(#(#items)*).to_string().replace(' ', "");
    assert!(text.contains("<Account>::last_seen(self,)"), "the method takes no request");
    assert!(text.contains("<Account>::touch(self,context,)"), "the context only");
    assert!(text.contains("constTAG:&'staticstr=\"LastSeen\";"));
    assert!(text.contains("pubasyncfnlast_seen(&self,entity_id:"));
    assert!(text.contains(".send(LastSeen).await"));
}

#[test]
fn arguments_name_the_type_the_crate_and_the_client() {
    let items = expand(
        quote!(name = "Bank", crate = durable_cluster, client = pub Accounts, client_tracing = false),
        account(),
    );
    let impls = trait_impls(&items);
    assert!(impls.iter().all(|(path, _)| path.starts_with("durable_cluster::")), "{impls:?}");
    let entity = entity_impl(&items).to_token_stream().to_string().replace(' ', "");
    assert!(entity.contains("constTYPE:&'staticstr=\"Bank\";"), "{entity}");
    assert!(entity.contains("constCLIENT_TRACING:bool=false;"), "{entity}");
    let client = items.iter().find_map(|item| match item {
        Item::Struct(client) if client.ident == "Accounts" => Some(client),
        _ => None,
    });
    assert!(matches!(client.unwrap().vis, syn::Visibility::Public(_)));
    // A string path works too.
    let items = expand(quote!(crate = "::durable_cluster"), account());
    assert!(trait_impls(&items).iter().all(|(path, _)| path.starts_with("::durable_cluster::")));
}

#[test]
fn without_create_the_entity_is_for_a_factory_only() {
    let items = expand(
        quote!(),
        quote! {
            impl Pinger {
                #[rpc]
                async fn ping(&mut self, _: Ping) -> Result<(), Never> { Ok(()) }
            }
        },
    );
    let entity = entity_impl(&items).to_token_stream().to_string().replace(' ', "");
    assert!(entity.contains("constFACTORY_ONLY:bool=true;"), "{entity}");
    assert!(entity.contains("::core::future::pending()"), "{entity}");
    // With `create`, it is not.
    let items = expand(quote!(), account());
    let entity = entity_impl(&items).to_token_stream().to_string();
    assert!(!entity.contains("FACTORY_ONLY"), "{entity}");
}

#[test]
fn hooks_are_delegated() {
    let items = expand(
        quote!(),
        quote! {
            impl Pinger {
                fn create() -> Self { Pinger }
                async fn on_stop(&mut self) {}
                fn shard_group(entity_id: &str) -> ShardGroup { ShardGroup::default_group() }
                fn protocol(protocol: &mut Protocol<Self>) { protocol.handle_forked::<Fork>(); }
                #[rpc(tag = "Pong")]
                fn ping(&mut self, _: Ping) -> Result<(), Never> { Ok(()) }
            }
        },
    );
    let entity = entity_impl(&items).to_token_stream().to_string().replace(' ', "");
    for expected in [
        "::core::future::ready(<Pinger>::create())",
        "<Pinger>::on_stop(self)",
        "<Pinger>::shard_group(entity_id)",
        "protocol.handle::<Ping>();<Pinger>::protocol(protocol);",
    ] {
        assert!(entity.contains(expected), "{expected} missing from {entity}");
    }
    let all: String = items.iter().map(|item| item.to_token_stream().to_string()).collect();
    let all = all.replace(' ', "");
    assert!(all.contains("constTAG:&'staticstr=\"Pong\";"), "{all}");
    // A synchronous handler is wrapped in a ready future.
    assert!(all.contains("::core::future::ready(<Pinger>::ping(self,request))"), "{all}");
}

#[test]
fn cfg_attributes_follow_their_method() {
    let items = expand(
        quote!(),
        quote! {
            impl Pinger {
                #[cfg(feature = "ping")]
                #[rpc]
                async fn ping(&mut self, _: Ping) -> Result<(), Never> { Ok(()) }
            }
        },
    );
    let all: String = items.iter().map(|item| item.to_token_stream().to_string()).collect();
    // On the Rpc and Handler impls, the protocol's declaration and the client's method.
    assert_eq!(all.matches("cfg (feature = \"ping\")").count(), 5, "{all}");
}

/// [`check_error`] on each `(attr, item, expected)`.
fn check_errors(cases: Vec<(TokenStream, TokenStream, &[&str])>) {
    for (attr, item, expected) in cases {
        check_error(attr, item, expected);
    }
}

/// The block and `#[entity(..)]`'s own arguments.
#[test]
fn entity_mistakes_are_reported_on_their_tokens() {
    check_errors(vec![
        (
            quote!(),
            quote!(impl Entity for Account {}),
            &["#[entity] goes on an inherent impl block"],
        ),
        (
            quote!(),
            quote!(
                impl<T> Account<T> {}
            ),
            &["does not take generic entity types"],
        ),
        (
            quote!(),
            quote!(
                struct Account;
            ),
            &["#[entity] goes on an inherent impl block"],
        ),
        (quote!(colour = "blue"), quote!(impl Account {}), &["unknown #[entity] argument"]),
        (quote!(name = "A", name = "B"), quote!(impl Account {}), &["given twice"]),
        (quote!(name = ""), quote!(impl Account {}), &["name is empty"]),
    ]);
}

/// `#[rpc(..)]` arguments.
#[test]
fn argument_mistakes_are_reported_on_their_tokens() {
    check_errors(vec![
        (
            quote!(),
            quote! {
                impl Account {
                    #[rpc(fast)]
                    async fn f(&mut self, r: R) -> Result<(), E> { Ok(()) }
                }
            },
            &["unknown #[rpc] argument", "persisted"],
        ),
        (
            quote!(),
            quote! {
                impl Account {
                    #[rpc(primary_key = key)]
                    async fn f(&mut self, r: R) -> Result<(), E> { Ok(()) }
                }
            },
            &["`primary_key` needs `persisted`"],
        ),
        (
            quote!(),
            quote! {
                impl Account {
                    #[rpc(with_transaction, deliver_at = at)]
                    async fn f(&mut self, r: R) -> Result<(), E> { Ok(()) }
                }
            },
            &["`with_transaction` needs `persisted`", "`deliver_at` needs `persisted`"],
        ),
        (
            quote!(),
            quote! {
                impl Account {
                    #[rpc(uninterruptible = "sometimes")]
                    async fn f(&mut self, r: R) -> Result<(), E> { Ok(()) }
                }
            },
            &["expected \\\"client\\\", \\\"server\\\" or \\\"both\\\""],
        ),
        (
            quote!(),
            quote! {
                impl Account {
                    #[rpc]
                    #[rpc]
                    async fn f(&mut self, r: R) -> Result<(), E> { Ok(()) }
                }
            },
            &["one #[rpc] per method"],
        ),
    ]);
}

/// The signature of an `#[rpc]` method.
#[test]
fn signature_mistakes_are_reported_on_their_tokens() {
    check_errors(vec![
        (
            quote!(),
            quote! {
                impl Account {
                    #[rpc]
                    async fn f(&mut self, r: &R) -> Result<(), E> { Ok(()) }
                }
            },
            &["the request is taken by value"],
        ),
        (
            quote!(),
            quote!(impl Account { #[rpc] async fn f(&mut self, r: R) -> u64 { 0 } }),
            &["returns `Result<Success, Error>`"],
        ),
        (
            quote!(),
            quote!(impl Account { #[rpc] async fn __(&mut self) -> Result<(), E> { Ok(()) } }),
            &["makes no request type's name"],
        ),
        (
            quote!(),
            quote!(impl Account { #[rpc] async fn f(&mut self, r: R) {} }),
            &["returns `Result<Success, Error>`"],
        ),
        (
            quote!(),
            quote!(impl Account { #[rpc] async fn f(&mut self, r: R) -> Result<u64> { Ok(0) } }),
            &["both spelled out"],
        ),
        (
            quote!(),
            quote!(impl Account { #[rpc] async fn f(self, r: R) -> Result<(), E> { Ok(()) } }),
            &["takes `&mut self`"],
        ),
        (
            quote!(),
            quote!(impl Account { #[rpc] async fn f(r: R) -> Result<(), E> { Ok(()) } }),
            &["takes `&mut self`"],
        ),
        (
            quote!(),
            quote! {
                impl Account {
                    #[rpc]
                    async fn f(&mut self, c: &C, r: R, x: X) -> Result<(), E> { Ok(()) }
                }
            },
            &["parameters are"],
        ),
        (
            quote!(),
            quote! {
                impl Account {
                    #[rpc]
                    async fn f(&mut self, c: C, r: R) -> Result<(), E> { Ok(()) }
                }
            },
            &["the first parameter is the context"],
        ),
        (
            quote!(),
            quote! {
                impl Account {
                    #[rpc]
                    async fn f<T>(&mut self, r: R) -> Result<(), E> { Ok(()) }
                }
            },
            &["is not generic"],
        ),
        (
            quote!(),
            quote! {
                impl Account {
                    #[rpc]
                    async fn f(&mut self, r: (A, B)) -> Result<(), E> { Ok(()) }
                }
            },
            &["no name to be its tag"],
        ),
    ]);
}

/// Streams.
#[test]
fn stream_mistakes_are_reported_on_their_tokens() {
    check_errors(vec![
        (
            quote!(),
            quote! {
                impl Account {
                    #[rpc(stream)]
                    async fn f(&mut self, r: R) -> Result<(), E> { Ok(()) }
                }
            },
            &["chunks: &mut Chunks<'_, Item>"],
        ),
        (
            quote!(),
            quote! {
                impl Account {
                    #[rpc(stream)]
                    async fn f(&mut self, r: R, x: X) -> Result<(), E> { Ok(()) }
                }
            },
            &["a stream's last parameter is `chunks"],
        ),
        (
            quote!(),
            quote! {
                impl Account {
                    #[rpc]
                    async fn f(&mut self, r: R, c: &mut Chunks<'_, u8>) -> Result<(), E> { Ok(()) }
                }
            },
            &["mark it `#[rpc(stream)]`"],
        ),
        (
            quote!(),
            quote! {
                impl Account {
                    #[rpc(stream)]
                    async fn f(&mut self, r: R, c: &mut Chunks<'_, u8>) -> Result<u8, E> { Ok(0) }
                }
            },
            &["a stream returns `Result<(), Error>`"],
        ),
        (
            quote!(),
            quote! {
                impl Account {
                    #[rpc(stream)]
                    async fn f(&self, r: R, c: &mut Chunks<'_, u8>) -> Result<(), E> { Ok(()) }
                }
            },
            &["a stream takes `&mut self`"],
        ),
        (
            quote!(),
            quote! {
                impl Account {
                    #[rpc(stream, uninterruptible)]
                    async fn f(&mut self, r: R, c: &mut Chunks<'_, u8>) -> Result<(), E> { Ok(()) }
                }
            },
            &["`uninterruptible` does not apply to a stream"],
        ),
    ]);
}

/// Hooks and the names the generated code takes.
#[test]
fn hook_mistakes_are_reported_on_their_tokens() {
    check_errors(vec![
        (
            quote!(),
            quote! {
                impl Account {
                    #[rpc]
                    async fn discard(&mut self, r: R) -> Result<(), E> { Ok(()) }
                }
            },
            &["cannot be named `discard`"],
        ),
        (
            quote!(),
            quote!(impl Account { fn client(&self) {} }),
            &["writes the entity's `client` function"],
        ),
        (
            quote!(),
            quote!(impl Account { fn create(&self) -> Self { Account } }),
            &["`create` is a hook of the entity"],
        ),
        (
            quote!(),
            quote!(impl Account { #[cfg(test)] fn on_stop(&mut self) {} }),
            &["cannot be conditional"],
        ),
    ]);
}

/// Two methods for one request type or tag.
#[test]
fn uniqueness_mistakes_are_reported_on_their_tokens() {
    check_errors(vec![
        (
            quote!(),
            quote! {
                impl Account {
                    #[rpc] async fn f(&mut self, r: R) -> Result<(), E> { Ok(()) }
                    #[rpc] async fn g(&mut self, r: R) -> Result<(), E> { Ok(()) }
                }
            },
            &["`R` is handled by `f` already"],
        ),
        (
            quote!(),
            quote! {
                impl Account {
                    #[rpc] async fn f(&mut self, r: R) -> Result<(), E> { Ok(()) }
                    #[rpc(tag = "R")] async fn g(&mut self, s: S) -> Result<(), E> { Ok(()) }
                }
            },
            &["the tag \\\"R\\\" is `f`'s already"],
        ),
    ]);
}

#[test]
fn every_mistake_of_a_block_is_reported_at_once() {
    let text = entity_tokens(
        quote!(),
        quote! {
            impl Account {
                #[rpc] async fn f(&mut self, r: &R) -> Result<(), E> { Ok(()) }
                #[rpc(primary_key = key)] async fn g(&mut self, s: S) -> Result<(), E> { Ok(()) }
            }
        },
        &runtime(),
    )
    .to_string();
    assert_eq!(text.matches("compile_error").count(), 2, "{text}");
}

#[test]
fn the_facade_form_names_the_facade_unless_told_otherwise() {
    let item = quote! {
        impl Account {
            #[rpc] async fn balance(&mut self, request: Balance) -> Result<u64, E> { Ok(0) }
        }
    };
    let facade: syn::Path = syn::parse_quote!(::durable_cluster);
    let text = entity_tokens(quote!(), item.clone(), &facade).to_string();
    assert!(text.contains(":: durable_cluster :: Rpc"), "{text}");
    assert!(!text.contains("cluster_sharding"), "{text}");
    let text = entity_tokens(quote!(crate = my_facade), item, &facade).to_string();
    assert!(text.contains("my_facade :: Rpc"), "{text}");
}
