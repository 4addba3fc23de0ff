//! Reading the input of `#[entity]`: its arguments, the impl block, the `#[rpc]` methods in it
//! and the methods with a meaning of their own (`create`, `on_stop`, `shard_group`,
//! `protocol`).
//!
//! Every mistake becomes a [`syn::Error`] on the tokens at fault; the errors of one impl block
//! are combined, so the compiler shows them all at once.

use std::collections::BTreeMap;

use proc_macro2::{Span, TokenStream};
use syn::meta::ParseNestedMeta;
use syn::parse::Parser;
use syn::spanned::Spanned;
use syn::{
    Attribute, Error, Expr, FnArg, GenericArgument, Ident, ImplItem, ImplItemFn, ItemImpl, LitBool,
    LitStr, Meta, Path, PathArguments, ReceiverKind, ReturnType, Type, Visibility,
};

/// The arguments of `#[entity(..)]`.
#[derive(Default)]
pub(crate) struct EntityArgs {
    /// `name = ".."`: the entity type's name.
    pub(crate) name: Option<LitStr>,
    /// `crate = path`: the path of the runtime crate.
    pub(crate) krate: Option<Path>,
    /// `client = [vis] Name`: the typed client's visibility and name.
    pub(crate) client: Option<(Visibility, Ident)>,
    /// `client_tracing = false`.
    pub(crate) client_tracing: Option<LitBool>,
    /// `state = field`: the durable state, a field of the entity (`None` inside: the whole
    /// value, `state = self`).
    pub(crate) state: Option<Option<syn::Member>>,
}

impl EntityArgs {
    /// Reads the tokens between the parentheses of `#[entity(..)]`.
    pub(crate) fn parse(tokens: TokenStream) -> syn::Result<EntityArgs> {
        let mut args = EntityArgs::default();
        let parser = syn::meta::parser(|meta| {
            if meta.path.is_ident("name") {
                let name: LitStr = meta.value()?.parse()?;
                if name.value().is_empty() {
                    return Err(Error::new(name.span(), "the entity type's name is empty"));
                }
                once(&mut args.name, name, &meta)
            } else if meta.path.is_ident("crate") {
                let value = meta.value()?;
                let path = if value.peek(LitStr) {
                    value.parse::<LitStr>()?.parse_with(Path::parse_mod_style)?
                } else {
                    Path::parse_mod_style(value)?
                };
                once(&mut args.krate, path, &meta)
            } else if meta.path.is_ident("client") {
                let value = meta.value()?;
                let visibility: Visibility = value.parse()?;
                let name: Ident = value.parse()?;
                once(&mut args.client, (visibility, name), &meta)
            } else if meta.path.is_ident("client_tracing") {
                let value: LitBool = meta.value()?.parse()?;
                once(&mut args.client_tracing, value, &meta)
            } else if meta.path.is_ident("state") {
                let value = meta.value()?;
                let field = if value.peek(syn::Token![self]) {
                    value.parse::<syn::Token![self]>()?;
                    None
                } else {
                    Some(value.parse::<syn::Member>()?)
                };
                once(&mut args.state, field, &meta)
            } else {
                Err(meta.error(
                    "unknown #[entity] argument; expected `name = \"..\"`, `crate = path`, \
                     `client = [visibility] Name`, `client_tracing = false` or `state = field`",
                ))
            }
        });
        parser.parse2(tokens)?;
        Ok(args)
    }
}

/// Sets an argument that may be given once.
fn once<T>(slot: &mut Option<T>, value: T, meta: &ParseNestedMeta<'_>) -> syn::Result<()> {
    if slot.is_some() {
        return Err(meta.error("this argument is given twice"));
    }
    *slot = Some(value);
    Ok(())
}

/// How a request reads one of its values: a field of the request, or a function of it.
pub(crate) enum Accessor {
    /// `primary_key = key`: the field `key`.
    Field(Ident),
    /// `primary_key = |deposit: &Deposit| ..` or a path to a function.
    Function(Expr),
}

impl Accessor {
    fn parse(meta: &ParseNestedMeta<'_>) -> syn::Result<Accessor> {
        let expr: Expr = meta.value()?.parse()?;
        if let Expr::Path(path) = &expr
            && path.qself.is_none()
            && let Some(ident) = path.path.get_ident()
        {
            return Ok(Accessor::Field(ident.clone()));
        }
        Ok(Accessor::Function(expr))
    }
}

/// Which side does not forward or act on interrupts (`uninterruptible = ..`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Uninterruptible {
    /// `"client"`.
    Client,
    /// `"server"`.
    Server,
    /// `"both"`, or the bare flag.
    Both,
}

/// The arguments of one `#[rpc(..)]`, each with the span of its name.
#[derive(Default)]
pub(crate) struct RpcArgs {
    /// `tag = ".."`.
    pub(crate) tag: Option<LitStr>,
    /// `persisted`.
    pub(crate) persisted: Option<Span>,
    /// `primary_key = ..`.
    pub(crate) primary_key: Option<(Span, Accessor)>,
    /// `deliver_at = ..`.
    pub(crate) deliver_at: Option<(Span, Accessor)>,
    /// `uninterruptible` or `uninterruptible = ".."`.
    pub(crate) uninterruptible: Option<(Span, Uninterruptible)>,
    /// `interrupt_on_termination`.
    pub(crate) interrupt_on_termination: Option<Span>,
    /// `with_transaction`, or `with_transaction = ..` to decide per request.
    pub(crate) with_transaction: Option<(Span, Option<Accessor>)>,
    /// `stream`.
    pub(crate) stream: Option<Span>,
}

/// The names `#[rpc(..)]` takes, for the error on any other.
const RPC_ARGUMENTS: &str = "`persisted`, `primary_key = ..`, `deliver_at = ..`, \
     `uninterruptible [= \"client\" | \"server\" | \"both\"]`, `interrupt_on_termination`, \
     `with_transaction [= ..]`, `stream` or `tag = \"..\"`";

impl RpcArgs {
    /// Reads one `#[rpc]` or `#[rpc(..)]` attribute.
    pub(crate) fn parse(attribute: &Attribute) -> syn::Result<RpcArgs> {
        let mut args = RpcArgs::default();
        match &attribute.meta {
            Meta::Path(_) => return Ok(args),
            Meta::List(_) => {}
            Meta::NameValue(meta) => {
                return Err(Error::new(meta.span(), "expected `#[rpc]` or `#[rpc(..)]`"));
            }
        }
        attribute.parse_nested_meta(|meta| {
            let span = meta.path.span();
            let path = &meta.path;
            if path.is_ident("tag") {
                let tag: LitStr = meta.value()?.parse()?;
                if tag.value().is_empty() {
                    return Err(Error::new(tag.span(), "the tag is empty"));
                }
                once(&mut args.tag, tag, &meta)
            } else if path.is_ident("persisted") {
                once(&mut args.persisted, span, &meta)
            } else if path.is_ident("primary_key") {
                let accessor = Accessor::parse(&meta)?;
                once(&mut args.primary_key, (span, accessor), &meta)
            } else if path.is_ident("deliver_at") {
                let accessor = Accessor::parse(&meta)?;
                once(&mut args.deliver_at, (span, accessor), &meta)
            } else if path.is_ident("uninterruptible") {
                let side = if meta.input.peek(syn::Token![=]) {
                    let side: LitStr = meta.value()?.parse()?;
                    match side.value().as_str() {
                        "client" => Uninterruptible::Client,
                        "server" => Uninterruptible::Server,
                        "both" => Uninterruptible::Both,
                        _ => {
                            return Err(Error::new(
                                side.span(),
                                "expected \"client\", \"server\" or \"both\"",
                            ));
                        }
                    }
                } else {
                    Uninterruptible::Both
                };
                once(&mut args.uninterruptible, (span, side), &meta)
            } else if path.is_ident("interrupt_on_termination") {
                once(&mut args.interrupt_on_termination, span, &meta)
            } else if path.is_ident("with_transaction") {
                let decide = if meta.input.peek(syn::Token![=]) {
                    Some(Accessor::parse(&meta)?)
                } else {
                    None
                };
                once(&mut args.with_transaction, (span, decide), &meta)
            } else if path.is_ident("stream") {
                once(&mut args.stream, span, &meta)
            } else {
                Err(meta.error(format!("unknown #[rpc] argument; expected {RPC_ARGUMENTS}")))
            }
        })?;
        Ok(args)
    }

    /// Checks the arguments against each other and against the kind of request.
    fn check(&self, errors: &mut Errors) {
        if self.persisted.is_none() {
            let volatile = "needs `persisted`: volatile requests are never deduplicated, \
                            delayed or run in a storage transaction";
            for (span, name) in [
                (self.primary_key.as_ref().map(|(span, _)| *span), "`primary_key`"),
                (self.deliver_at.as_ref().map(|(span, _)| *span), "`deliver_at`"),
                (self.with_transaction.as_ref().map(|(span, _)| *span), "`with_transaction`"),
            ] {
                if let Some(span) = span {
                    errors.push(Error::new(span, format!("{name} {volatile}")));
                }
            }
        }
        if self.stream.is_some() {
            for (span, name) in [
                (self.deliver_at.as_ref().map(|(span, _)| *span), "`deliver_at`"),
                (self.uninterruptible.as_ref().map(|(span, _)| *span), "`uninterruptible`"),
                (self.interrupt_on_termination, "`interrupt_on_termination`"),
                (self.with_transaction.as_ref().map(|(span, _)| *span), "`with_transaction`"),
            ] {
                if let Some(span) = span {
                    errors.push(Error::new(
                        span,
                        format!(
                            "{name} does not apply to a stream; a stream takes `tag`, \
                             `persisted` and `primary_key`"
                        ),
                    ));
                }
            }
        }
    }
}

/// What a request gets back.
pub(crate) enum Reply {
    /// One value: the `S` of `Result<S, E>`.
    Unary {
        /// `S`.
        success: Type,
    },
    /// Items through `chunks: &mut Chunks<'_, Item>`, then `Result<(), E>`.
    Stream {
        /// `Item`.
        item: Type,
    },
}

/// One `#[rpc]` method.
pub(crate) struct RpcMethod {
    /// The method's name, and the typed client's method.
    pub(crate) name: Ident,
    /// The arguments of its `#[rpc(..)]`.
    pub(crate) args: RpcArgs,
    /// `&self` (a shared handler) rather than `&mut self`.
    pub(crate) shared: bool,
    /// Whether it takes the `&RequestContext` before the request.
    pub(crate) context: bool,
    /// `async fn` rather than `fn`.
    pub(crate) asynchronous: bool,
    /// The request type.
    pub(crate) request: Type,
    /// Whether the method takes no request: the request type, a unit struct named after the
    /// method, is generated.
    pub(crate) generated: bool,
    /// Its reply.
    pub(crate) reply: Reply,
    /// The `E` of `Result<_, E>`.
    pub(crate) error: Type,
    /// Its `#[cfg(..)]` attributes, repeated on everything generated for it.
    pub(crate) cfgs: Vec<Attribute>,
    /// Its doc comment, repeated on the typed client's method.
    pub(crate) docs: Vec<Attribute>,
    /// Its signature, where errors about the generated code point.
    pub(crate) span: Span,
}

impl RpcMethod {
    /// The request's tag: `tag = ".."` or the last segment of the request type's path.
    pub(crate) fn tag(&self) -> Option<String> {
        if let Some(tag) = &self.args.tag {
            return Some(tag.value());
        }
        match &self.request {
            Type::Path(path) if path.qself.is_none() => {
                path.path.segments.last().map(|segment| segment.ident.to_string())
            }
            _ => None,
        }
    }
}

/// A method with a meaning of its own in the entity: `create`, `on_stop`, `shard_group` or
/// `protocol`.
pub(crate) struct Hook {
    /// `async fn` rather than `fn`.
    pub(crate) asynchronous: bool,
    /// How many parameters it takes besides `self`.
    pub(crate) inputs: usize,
}

/// The hooks of an entity, each optional.
#[derive(Default)]
pub(crate) struct Hooks {
    /// `[async] fn create([context: &EntityContext]) -> Self`.
    pub(crate) create: Option<Hook>,
    /// `[async] fn on_stop(&mut self)`.
    pub(crate) on_stop: Option<Hook>,
    /// `fn shard_group(entity_id: &str) -> ShardGroup`.
    pub(crate) shard_group: Option<Hook>,
    /// `fn protocol(protocol: &mut Protocol<Self>)`: registrations of its own.
    pub(crate) protocol: Option<Hook>,
}

/// The names the generated code gives to methods: an `#[rpc]` method may not take them.
const RESERVED: [(&str, &str); 3] = [
    ("client", "the entity's `client` function (the typed client's constructor)"),
    ("entity", "the typed client's `entity` method"),
    ("discard", "the typed client's `discard` method"),
];

/// One entity: `#[entity]`'s arguments and the impl block it was put on.
pub(crate) struct EntityDef {
    pub(crate) args: EntityArgs,
    /// The impl block, without its `#[rpc]` attributes: the methods stay as written.
    pub(crate) item: ItemImpl,
    /// The last segment of the entity type's path: the default name and client name.
    pub(crate) self_name: Ident,
    pub(crate) rpcs: Vec<RpcMethod>,
    pub(crate) hooks: Hooks,
}

/// The errors found so far; they are reported together.
#[derive(Default)]
struct Errors(Option<Error>);

impl Errors {
    fn push(&mut self, error: Error) {
        match &mut self.0 {
            Some(errors) => errors.combine(error),
            None => self.0 = Some(error),
        }
    }

    fn finish(self) -> syn::Result<()> {
        self.0.map_or(Ok(()), Err)
    }
}

impl EntityDef {
    /// Reads `#[entity(attr)]` on `item`.
    pub(crate) fn parse(attr: TokenStream, item: TokenStream) -> syn::Result<EntityDef> {
        let args = EntityArgs::parse(attr)?;
        let mut item: ItemImpl = syn::parse2(item).map_err(|error| {
            Error::new(
                error.span(),
                format!(
                    "#[entity] goes on an inherent impl block (`impl Account {{ .. }}`): {error}"
                ),
            )
        })?;
        let self_name = entity_name(&item)?;
        let mut errors = Errors::default();
        let mut rpcs = Vec::new();
        let mut hooks = Hooks::default();
        for impl_item in &mut item.items {
            let ImplItem::Fn(method) = impl_item else { continue };
            match take_rpc_attribute(method) {
                Ok(Some(attribute)) => {
                    match RpcArgs::parse(&attribute).and_then(|args| rpc_method(method, args)) {
                        Ok(rpc) => rpcs.push(rpc),
                        Err(error) => errors.push(error),
                    }
                }
                Ok(None) => {
                    if let Err(error) = hook(method, &mut hooks) {
                        errors.push(error);
                    }
                }
                Err(error) => errors.push(error),
            }
        }
        check_unique(&rpcs, &mut errors);
        errors.finish()?;
        Ok(EntityDef { args, item, self_name, rpcs, hooks })
    }
}

/// The impl block `item` without the `#[rpc]` attributes of its methods; `item` itself if it
/// is not an impl block.
pub(crate) fn without_rpc_attributes(item: TokenStream) -> TokenStream {
    let Ok(mut parsed) = syn::parse2::<ItemImpl>(item.clone()) else { return item };
    for impl_item in &mut parsed.items {
        if let ImplItem::Fn(method) = impl_item {
            method.attrs.retain(|attribute| !attribute.path().is_ident("rpc"));
        }
    }
    quote::ToTokens::into_token_stream(parsed)
}

/// The last segment of the entity type of an inherent, non-generic impl block.
fn entity_name(item: &ItemImpl) -> syn::Result<Ident> {
    if let Some((path, _)) = &item.trait_ {
        return Err(Error::new(
            path.span(),
            "#[entity] goes on an inherent impl block (`impl Account { .. }`), not on a trait \
             impl",
        ));
    }
    if !item.generics.params.is_empty() {
        return Err(Error::new(
            item.generics.span(),
            "#[entity] does not take generic entity types: implement `Entity` and the \
             handlers by hand for those",
        ));
    }
    let not_a_name = || {
        Error::new(
            item.self_ty.span(),
            "#[entity] needs the entity type by name, such as `Account`",
        )
    };
    let Type::Path(path) = &*item.self_ty else { return Err(not_a_name()) };
    let segment = path.path.segments.last().ok_or_else(not_a_name)?;
    if path.qself.is_some() || !matches!(segment.arguments, PathArguments::None) {
        return Err(not_a_name());
    }
    Ok(segment.ident.clone())
}

/// Removes the method's `#[rpc]` attribute and returns it; an error if it has several.
fn take_rpc_attribute(method: &mut ImplItemFn) -> syn::Result<Option<Attribute>> {
    let mut found: Option<Attribute> = None;
    let mut kept = Vec::with_capacity(method.attrs.len());
    for attribute in method.attrs.drain(..) {
        if !attribute.path().is_ident("rpc") {
            kept.push(attribute);
        } else if found.is_some() {
            return Err(Error::new(attribute.span(), "one #[rpc] per method"));
        } else {
            found = Some(attribute);
        }
    }
    method.attrs = kept;
    Ok(found)
}

/// The attributes of `attributes` named `name`.
fn attributes_named(attributes: &[Attribute], name: &str) -> Vec<Attribute> {
    attributes.iter().filter(|attribute| attribute.path().is_ident(name)).cloned().collect()
}

/// Reads one `#[rpc]` method.
fn rpc_method(method: &ImplItemFn, args: RpcArgs) -> syn::Result<RpcMethod> {
    let sig = &method.sig;
    let mut errors = Errors::default();
    args.check(&mut errors);
    if let Some((name, what)) = RESERVED.iter().find(|(name, _)| sig.ident == *name) {
        errors.push(Error::new(
            sig.ident.span(),
            format!("an #[rpc] method cannot be named `{name}`: that is {what}"),
        ));
    }
    plain_signature(sig, &mut errors);
    let shared = shared_receiver(sig)?;
    let stream = args.stream.is_some();
    if shared && stream {
        errors.push(Error::new(sig.ident.span(), "a stream takes `&mut self`, not `&self`"));
    }
    let (context, request, chunks_item) = parameters(sig, stream, &mut errors)?;
    let generated = request.is_none();
    let request = match request {
        Some(request) => request,
        None => generated_request(&sig.ident)?,
    };
    let ReturnType::Type(_, output) = &sig.output else {
        let expected = if stream { "`Result<(), Error>`" } else { "`Result<Success, Error>`" };
        errors.push(Error::new(sig.span(), format!("an #[rpc] method returns {expected}")));
        errors.finish()?;
        return Err(Error::new(sig.span(), "no return type"));
    };
    let (success, error) = result_types(output)?;
    let reply = match chunks_item {
        Some(item) if stream => {
            if !matches!(&success, Type::Tuple(tuple) if tuple.elems.is_empty()) {
                errors.push(Error::new(
                    success.span(),
                    "a stream returns `Result<(), Error>`: its items go through `chunks`",
                ));
            }
            Reply::Stream { item }
        }
        _ => Reply::Unary { success },
    };
    errors.finish()?;
    let rpc = RpcMethod {
        name: sig.ident.clone(),
        args,
        shared,
        context,
        asynchronous: sig.asyncness.is_some(),
        request,
        generated,
        reply,
        error,
        cfgs: attributes_named(&method.attrs, "cfg"),
        docs: attributes_named(&method.attrs, "doc"),
        span: sig.span(),
    };
    if rpc.tag().is_none() {
        return Err(Error::new(
            rpc.request.span(),
            "this request type has no name to be its tag: give one with `tag = \"..\"`",
        ));
    }
    Ok(rpc)
}

/// Whether the method takes `&self` (a shared handler) rather than `&mut self`; an error for
/// any other receiver, or none.
fn shared_receiver(sig: &syn::Signature) -> syn::Result<bool> {
    let message = "an #[rpc] method takes `&mut self` (requests one at a time) or `&self` \
                   (shared requests, run side by side)";
    let Some(receiver) = sig.receiver() else {
        return Err(Error::new(sig.ident.span(), message));
    };
    match &receiver.kind {
        ReceiverKind::Reference(_, _, mutability) if receiver.mutability.is_none() => {
            Ok(mutability.is_none())
        }
        _ => Err(Error::new(receiver.span(), message)),
    }
}

/// Reads the parameters after `self`: whether the context comes first, the request type, and
/// the item type of the `chunks` parameter, if the last one is `&mut Chunks<'_, Item>` (it must
/// be, for a stream).
fn parameters(
    sig: &syn::Signature,
    stream: bool,
    errors: &mut Errors,
) -> syn::Result<(bool, Option<Type>, Option<Type>)> {
    let inputs: Vec<&Type> = sig
        .inputs
        .iter()
        .filter_map(|input| match input {
            FnArg::Typed(typed) => Some(&*typed.ty),
            FnArg::Receiver(_) => None,
        })
        .collect();
    let shape = if stream {
        "`(&mut self, [context: &RequestContext,] request: Request, chunks: &mut Chunks<'_, Item>)`"
    } else {
        "`(&mut self, [context: &RequestContext,] request: Request)`"
    };
    // A unary method may take no request (then its request type is generated): nothing, or
    // only the context, a shared reference (a request is taken by value).
    if !stream {
        match inputs.as_slice() {
            [] => return Ok((false, None, None)),
            [Type::Reference(reference)]
                if reference.mutability.is_none() && names(&reference.elem, "RequestContext") =>
            {
                return Ok((true, None, None));
            }
            _ => {}
        }
    }
    let fixed = if stream { 2 } else { 1 };
    let context = match inputs.len() {
        n if n == fixed => false,
        n if n == fixed + 1 => true,
        _ => {
            let message = format!("an #[rpc] method's parameters are {shape}");
            return Err(Error::new(sig.inputs.span(), message));
        }
    };
    if context
        && let Some(first) = inputs.first()
        && !matches!(first, Type::Reference(reference) if reference.mutability.is_none())
    {
        errors.push(Error::new(
            first.span(),
            format!(
                "the first parameter is the context, `&RequestContext`; an #[rpc] method's \
                 parameters are {shape}"
            ),
        ));
    }
    let request = inputs.get(usize::from(context)).map(|request| (*request).clone());
    let request = request.ok_or_else(|| Error::new(sig.inputs.span(), "no request parameter"))?;
    if let Type::Reference(reference) = &request {
        errors.push(Error::new(
            reference.span(),
            "the request is taken by value, such as `request: Deposit`",
        ));
    }
    let last = inputs.last().copied();
    let item = last.and_then(chunks_item);
    match (&item, stream) {
        (Some(_), false) => errors.push(Error::new(
            sig.ident.span(),
            "this method takes `Chunks`: mark it `#[rpc(stream)]`",
        )),
        (None, true) => errors.push(Error::new(
            last.map_or_else(|| sig.span(), Spanned::span),
            "a stream's last parameter is `chunks: &mut Chunks<'_, Item>`",
        )),
        _ => {}
    }
    Ok((context, Some(request), item))
}

/// The request type generated for a method that takes none: the method's name in
/// `UpperCamelCase` (`balance` becomes `Balance`, `last_seen` becomes `LastSeen`).
fn generated_request(method: &Ident) -> syn::Result<Type> {
    let name: String = method
        .to_string()
        .trim_start_matches("r#")
        .split('_')
        .filter(|word| !word.is_empty())
        .map(|word| {
            let mut letters = word.chars();
            letters
                .next()
                .map(|first| first.to_uppercase().chain(letters).collect::<String>())
                .unwrap_or_default()
        })
        .collect();
    if name.is_empty() {
        let message = "this method's name makes no request type's name: take a request, such as \
                       `request: Get`";
        return Err(Error::new(method.span(), message));
    }
    let ident = Ident::new(&name, method.span());
    Ok(syn::parse_quote!(#ident))
}

/// Whether `ty` is a path whose last segment is `name`.
fn names(ty: &Type, name: &str) -> bool {
    matches!(ty, Type::Path(path) if path.path.segments.last().is_some_and(|last| last.ident == name))
}

/// Refuses what a handler cannot be: `const`, `extern`, generic, variadic.
fn plain_signature(sig: &syn::Signature, errors: &mut Errors) {
    if let Some(constness) = &sig.constness {
        errors.push(Error::new(constness.span(), "an #[rpc] method is not `const`"));
    }
    if let Some(abi) = &sig.abi {
        errors.push(Error::new(abi.span(), "an #[rpc] method has the Rust ABI"));
    }
    if !sig.generics.params.is_empty() {
        errors.push(Error::new(sig.generics.span(), "an #[rpc] method is not generic"));
    }
    if let Some(variadic) = &sig.variadic {
        errors.push(Error::new(variadic.span(), "an #[rpc] method is not variadic"));
    }
}

/// The `Item` of `&mut Chunks<'_, Item>` (by the last segment's name).
fn chunks_item(ty: &Type) -> Option<Type> {
    let Type::Reference(reference) = ty else { return None };
    reference.mutability?;
    let Type::Path(path) = &*reference.elem else { return None };
    let segment = path.path.segments.last()?;
    if segment.ident != "Chunks" {
        return None;
    }
    let PathArguments::AngleBracketed(arguments) = &segment.arguments else { return None };
    arguments.args.iter().rev().find_map(|argument| match argument {
        GenericArgument::Type(item) => Some(item.clone()),
        _ => None,
    })
}

/// The `S` and `E` of `Result<S, E>` (by the last segment's name).
fn result_types(output: &Type) -> syn::Result<(Type, Type)> {
    let expected = || {
        Error::new(
            output.span(),
            "an #[rpc] method returns `Result<Success, Error>`, both spelled out (use \
             `Never` as the error of a request that cannot fail)",
        )
    };
    let Type::Path(path) = output else { return Err(expected()) };
    let segment = path.path.segments.last().ok_or_else(expected)?;
    if segment.ident != "Result" {
        return Err(expected());
    }
    let PathArguments::AngleBracketed(arguments) = &segment.arguments else {
        return Err(expected());
    };
    let mut types = arguments.args.iter().filter_map(|argument| match argument {
        GenericArgument::Type(ty) => Some(ty.clone()),
        _ => None,
    });
    match (types.next(), types.next(), types.next()) {
        (Some(success), Some(error), None) => Ok((success, error)),
        _ => Err(expected()),
    }
}

/// Reads a method without `#[rpc]`: a hook if its name is one, else nothing.
fn hook(method: &ImplItemFn, hooks: &mut Hooks) -> syn::Result<()> {
    let sig = &method.sig;
    let name = sig.ident.to_string();
    let receiver = sig.receiver();
    let inputs = sig.inputs.iter().filter(|input| matches!(input, FnArg::Typed(_))).count();
    let asynchronous = sig.asyncness.is_some();
    let (slot, fits, shape) = match name.as_str() {
        "create" => (
            &mut hooks.create,
            receiver.is_none() && inputs <= 1,
            "`[async] fn create([context: &EntityContext]) -> Self`",
        ),
        "on_stop" => (
            &mut hooks.on_stop,
            receiver.is_some_and(|receiver| {
                matches!(receiver.kind, ReceiverKind::Reference(_, _, Some(_)))
            }) && inputs == 0,
            "`[async] fn on_stop(&mut self)`",
        ),
        "shard_group" => (
            &mut hooks.shard_group,
            receiver.is_none() && inputs == 1 && !asynchronous,
            "`fn shard_group(entity_id: &str) -> ShardGroup`",
        ),
        "protocol" => (
            &mut hooks.protocol,
            receiver.is_none() && inputs == 1 && !asynchronous,
            "`fn protocol(protocol: &mut Protocol<Self>)`",
        ),
        "client" => {
            return Err(Error::new(
                sig.ident.span(),
                "#[entity] writes the entity's `client` function (the typed client's \
                 constructor): rename this method",
            ));
        }
        _ => return Ok(()),
    };
    if !fits || !sig.generics.params.is_empty() {
        return Err(Error::new(
            sig.span(),
            format!("in an #[entity] impl block, `{name}` is a hook of the entity: {shape}"),
        ));
    }
    if let Some(cfg) = method.attrs.iter().find(|attribute| attribute.path().is_ident("cfg")) {
        return Err(Error::new(
            cfg.span(),
            format!("the hook `{name}` cannot be conditional: #[entity] calls it unconditionally"),
        ));
    }
    *slot = Some(Hook { asynchronous, inputs });
    Ok(())
}

/// Two `#[rpc]` methods may share neither a request type nor a tag.
fn check_unique(rpcs: &[RpcMethod], errors: &mut Errors) {
    let mut types = BTreeMap::new();
    let mut tags = BTreeMap::new();
    for rpc in rpcs {
        let request = type_text(&rpc.request);
        if let Some(first) = types.insert(request.clone(), &rpc.name) {
            errors.push(Error::new(
                rpc.request.span(),
                format!("`{request}` is handled by `{first}` already: one method per request type"),
            ));
        }
        if let Some(tag) = rpc.tag()
            && let Some(first) = tags.insert(tag.clone(), &rpc.name)
        {
            errors.push(Error::new(
                rpc.args.tag.as_ref().map_or_else(|| rpc.request.span(), LitStr::span),
                format!("the tag \"{tag}\" is `{first}`'s already: tags are unique in an entity"),
            ));
        }
    }
}

/// The tokens of a type as text, for comparing types and naming them in errors.
fn type_text(ty: &Type) -> String {
    quote::ToTokens::to_token_stream(ty).to_string()
}
