//! Writing what `#[entity]` generates: the impl block as written (without its `#[rpc]`
//! attributes), one `Rpc` or `StreamRpc` implementation per request type, one handler
//! implementation per `#[rpc]` method, the `Entity` implementation whose protocol lists them
//! all, and the typed client.
//!
//! Every path to the runtime starts with the `crate = ..` argument (`::cluster_sharding` by
//! default); every other path is absolute (`::core::..`, `::std::..`), so the expansion means
//! the same wherever it is written.

use proc_macro2::TokenStream;
use quote::{format_ident, quote, quote_spanned};
use syn::{Path, Type};

use crate::parse::{Accessor, EntityDef, Hooks, Reply, RpcMethod, Uninterruptible};

/// Everything `#[entity]` writes for `def`; the runtime is at `default_crate` unless the
/// arguments say otherwise.
pub(crate) fn expand(def: &EntityDef, default_crate: &Path) -> TokenStream {
    let krate: Path = def.args.krate.clone().unwrap_or_else(|| default_crate.clone());
    let item = &def.item;
    let self_ty = &*def.item.self_ty;
    let requests = def.rpcs.iter().map(|rpc| request_impl(&krate, rpc));
    let handlers = def.rpcs.iter().map(|rpc| handler_impl(&krate, self_ty, rpc));
    let entity = entity_impl(&krate, def);
    let client = client(&krate, def);
    quote! {
        #item
        #(#requests)*
        #(#handlers)*
        #entity
        #client
    }
}

/// The entity type's name: `name = ".."` or the type's.
fn type_name(def: &EntityDef) -> String {
    def.args.name.as_ref().map_or_else(|| def.self_name.to_string(), syn::LitStr::value)
}

/// `impl Rpc for Request` or `impl StreamRpc for Request`.
fn request_impl(krate: &Path, rpc: &RpcMethod) -> TokenStream {
    let RpcMethod { request, error, cfgs, args, .. } = rpc;
    let tag = rpc.tag().unwrap_or_default();
    let persisted = args.persisted.map(|span| quote_spanned!(span=> const PERSISTED: bool = true;));
    let primary_key = args.primary_key.as_ref().map(|(_, key)| {
        let value = accessor_value(key);
        quote! {
            fn primary_key(&self) -> ::core::option::Option<::std::string::String> {
                ::core::convert::Into::into(#value)
            }
        }
    });
    match &rpc.reply {
        Reply::Unary { success } => {
            let uninterruptible = args.uninterruptible.map(|(span, side)| {
                let side = match side {
                    Uninterruptible::Client => quote!(Client),
                    Uninterruptible::Server => quote!(Server),
                    Uninterruptible::Both => quote!(Both),
                };
                quote_spanned! {span=>
                    const UNINTERRUPTIBLE: #krate::Uninterruptible = #krate::Uninterruptible::#side;
                }
            });
            let interrupt_on_termination = args
                .interrupt_on_termination
                .map(|span| quote_spanned!(span=> const INTERRUPT_ON_TERMINATION: bool = true;));
            let with_transaction =
                args.with_transaction.as_ref().map(|(span, decide)| match decide {
                    None => quote_spanned!(*span=> const WITH_TRANSACTION: bool = true;),
                    Some(decide) => {
                        let value = accessor_value(decide);
                        quote_spanned! {*span=>
                            const WITH_TRANSACTION_PER_REQUEST: bool = true;
                            fn with_transaction(&self) -> bool {
                                #value
                            }
                        }
                    }
                });
            let deliver_at = args.deliver_at.as_ref().map(|(_, at)| {
                let option = quote!(::core::option::Option<#krate::__private::Timestamp>);
                let value = accessor_value(at);
                quote! {
                    fn deliver_at(&self) -> #option {
                        ::core::convert::Into::into(#value)
                    }
                }
            });
            quote! {
                #(#cfgs)*
                impl #krate::Rpc for #request {
                    const TAG: &'static str = #tag;
                    #persisted
                    #uninterruptible
                    #interrupt_on_termination
                    #with_transaction
                    type Success = #success;
                    type Error = #error;
                    #primary_key
                    #deliver_at
                }
            }
        }
        Reply::Stream { item } => quote! {
            #(#cfgs)*
            impl #krate::StreamRpc for #request {
                const TAG: &'static str = #tag;
                #persisted
                type Item = #item;
                type Error = #error;
                #primary_key
            }
        },
    }
}

/// The value an accessor reads from `self` (the request): a clone of the field, or the
/// function's result. The function is coerced to `fn(&Self) -> _` first, which types the
/// parameter of a closure written without an annotation.
fn accessor_value(accessor: &Accessor) -> TokenStream {
    match accessor {
        Accessor::Field(field) => quote!(::core::clone::Clone::clone(&self.#field)),
        Accessor::Function(function) => quote! {{
            let read: fn(&Self) -> _ = #function;
            read(self)
        }},
    }
}

/// `impl Handler<Request>`, `impl SharedHandler<Request>` or `impl StreamHandler<Request>`,
/// delegating to the method.
fn handler_impl(krate: &Path, self_ty: &Type, rpc: &RpcMethod) -> TokenStream {
    let RpcMethod { name, request, cfgs, .. } = rpc;
    let context = if rpc.context { quote!(context) } else { quote!(_context) };
    let forwarded = rpc.context.then(|| quote!(context,));
    let receiver = if rpc.shared { quote!(&self) } else { quote!(&mut self) };
    match &rpc.reply {
        Reply::Unary { .. } => {
            let call = quote_spanned!(rpc.span=> <#self_ty>::#name(self, #forwarded request));
            let call = if rpc.asynchronous { call } else { quote!(::core::future::ready(#call)) };
            let handler = if rpc.shared { quote!(SharedHandler) } else { quote!(Handler) };
            quote! {
                #(#cfgs)*
                impl #krate::#handler<#request> for #self_ty {
                    fn handle(
                        #receiver,
                        #context: &#krate::RequestContext,
                        request: #request,
                    ) -> impl ::core::future::Future<
                        Output = ::core::result::Result<
                            <#request as #krate::Rpc>::Success,
                            <#request as #krate::Rpc>::Error,
                        >,
                    > + ::core::marker::Send {
                        #call
                    }
                }
            }
        }
        Reply::Stream { .. } => {
            let call =
                quote_spanned!(rpc.span=> <#self_ty>::#name(self, #forwarded request, chunks));
            let call = if rpc.asynchronous { call } else { quote!(::core::future::ready(#call)) };
            quote! {
                #(#cfgs)*
                impl #krate::StreamHandler<#request> for #self_ty {
                    fn handle(
                        &mut self,
                        #context: &#krate::RequestContext,
                        request: #request,
                        chunks: &mut #krate::Chunks<'_, <#request as #krate::StreamRpc>::Item>,
                    ) -> impl ::core::future::Future<
                        Output = ::core::result::Result<(), <#request as #krate::StreamRpc>::Error>,
                    > + ::core::marker::Send {
                        #call
                    }
                }
            }
        }
    }
}

/// `impl Entity`: the name, `create` (the hook's, or `FACTORY_ONLY` and one that never runs),
/// the protocol listing every `#[rpc]`, and the other hooks.
fn entity_impl(krate: &Path, def: &EntityDef) -> TokenStream {
    let self_ty = &*def.item.self_ty;
    let name = type_name(def);
    let Hooks { create, on_stop, shard_group, protocol } = &def.hooks;
    let client_tracing = def
        .args
        .client_tracing
        .as_ref()
        .map(|tracing| quote!(const CLIENT_TRACING: bool = #tracing;));
    let create = match create {
        Some(hook) => {
            let (parameter, argument) = if hook.inputs == 1 {
                (quote!(context), quote!(context))
            } else {
                (quote!(_context), quote!())
            };
            let call = quote!(<#self_ty>::create(#argument));
            let call = if hook.asynchronous { call } else { quote!(::core::future::ready(#call)) };
            quote! {
                fn create(
                    #parameter: &#krate::EntityContext,
                ) -> impl ::core::future::Future<Output = Self> + ::core::marker::Send {
                    #call
                }
            }
        }
        // Never called: `FACTORY_ONLY` makes a registration of the type without a factory fail to build.
        None => quote! {
            const FACTORY_ONLY: bool = true;
            fn create(
                _context: &#krate::EntityContext,
            ) -> impl ::core::future::Future<Output = Self> + ::core::marker::Send {
                ::core::future::pending()
            }
        },
    };
    let on_stop = on_stop.as_ref().map(|hook| {
        let call = quote!(<#self_ty>::on_stop(self));
        let call = if hook.asynchronous { call } else { quote!(::core::future::ready(#call)) };
        quote! {
            fn on_stop(&mut self) -> impl ::core::future::Future<Output = ()> + ::core::marker::Send {
                #call
            }
        }
    });
    let shard_group = shard_group.as_ref().map(|_| {
        quote! {
            fn shard_group(entity_id: &str) -> #krate::__private::ShardGroup {
                <#self_ty>::shard_group(entity_id)
            }
        }
    });
    let registrations = def.rpcs.iter().map(|rpc| {
        let RpcMethod { request, cfgs, .. } = rpc;
        let declare = match (&rpc.reply, rpc.shared) {
            (Reply::Stream { .. }, _) => quote!(stream),
            (Reply::Unary { .. }, true) => quote!(handle_shared),
            (Reply::Unary { .. }, false) => quote!(handle),
        };
        quote! {
            #(#cfgs)*
            protocol.#declare::<#request>();
        }
    });
    let own_protocol = protocol.as_ref().map(|_| quote!(<#self_ty>::protocol(protocol);));
    quote! {
        impl #krate::Entity for #self_ty {
            const TYPE: &'static str = #name;
            #client_tracing
            #create
            fn protocol(protocol: &mut #krate::Protocol<Self>) {
                #(#registrations)*
                #own_protocol
            }
            #on_stop
            #shard_group
        }
    }
}

/// The typed client: a struct holding the runtime, the entity's `client` constructor, and
/// one method per `#[rpc]` taking the entity id.
fn client(krate: &Path, def: &EntityDef) -> TokenStream {
    let self_ty = &*def.item.self_ty;
    let name = type_name(def);
    let (visibility, client) = match &def.args.client {
        Some((visibility, client)) => (visibility.clone(), client.clone()),
        None => (syn::Visibility::Inherited, format_ident!("{}Client", def.self_name)),
    };
    let entity_id = quote!(impl ::core::convert::Into<#krate::__private::EntityId>);
    let struct_doc = format!(
        "The typed client of the `{name}` entity type: one method per request, each taking \
         the entity id. Made by `{}::client`; cheap to clone.",
        def.self_name
    );
    let methods = def.rpcs.iter().map(|rpc| client_method(krate, rpc, &visibility, &entity_id));
    quote! {
        #[doc = #struct_doc]
        #[derive(Clone, Debug)]
        #[allow(dead_code, reason = "generated: a client may leave some requests unsent")]
        #visibility struct #client {
            sharding: #krate::Sharding,
        }

        #[allow(dead_code, reason = "generated: a client may leave some requests unsent")]
        impl #self_ty {
            /// The typed client of this entity type on `sharding`: one method per request,
            /// each taking the entity id.
            #visibility fn client(sharding: &#krate::Sharding) -> #client {
                #client { sharding: ::core::clone::Clone::clone(sharding) }
            }
        }

        #[allow(dead_code, reason = "generated: a client may leave some requests unsent")]
        impl #client {
            /// The client of the entity `entity_id`, for what the typed methods leave out
            /// (headers, its address).
            #visibility fn entity(&self, entity_id: #entity_id) -> #krate::EntityClient<#self_ty> {
                self.sharding.client::<#self_ty>(entity_id)
            }

            /// Sends `request` to the entity `entity_id` without waiting for its reply:
            /// returns once it is delivered (stored, for a persisted request).
            #visibility async fn discard<R: #krate::Rpc>(
                &self,
                entity_id: #entity_id,
                request: R,
            ) -> ::core::result::Result<(), #krate::CallError<<R as #krate::Rpc>::Error>>
            where
                #self_ty: #krate::Handler<R>,
            {
                self.entity(entity_id).discard(request).await
            }

            #(#methods)*
        }
    }
}

/// The typed client's method for one `#[rpc]`.
fn client_method(
    krate: &Path,
    rpc: &RpcMethod,
    visibility: &syn::Visibility,
    entity_id: &TokenStream,
) -> TokenStream {
    let RpcMethod { name, request, cfgs, docs, .. } = rpc;
    let request_name = quote!(#request).to_string();
    match &rpc.reply {
        Reply::Unary { .. } => {
            let doc = docs.is_empty().then(|| {
                let doc = format!(
                    "Sends a `{request_name}` to the entity `entity_id` and waits for its reply."
                );
                quote!(#[doc = #doc])
            });
            quote! {
                #(#cfgs)*
                #(#docs)*
                #doc
                #visibility async fn #name(
                    &self,
                    entity_id: #entity_id,
                    request: #request,
                ) -> ::core::result::Result<
                    <#request as #krate::Rpc>::Success,
                    #krate::CallError<<#request as #krate::Rpc>::Error>,
                > {
                    self.entity(entity_id).send(request).await
                }
            }
        }
        Reply::Stream { .. } => {
            let doc = docs.is_empty().then(|| {
                let doc = format!(
                    "Sends the streaming `{request_name}` to the entity `entity_id` and returns \
                     its items as they come."
                );
                quote!(#[doc = #doc])
            });
            quote! {
                #(#cfgs)*
                #(#docs)*
                #doc
                #visibility async fn #name(
                    &self,
                    entity_id: #entity_id,
                    request: #request,
                ) -> ::core::result::Result<
                    #krate::ChunkStream<#request>,
                    #krate::CallError<<#request as #krate::StreamRpc>::Error>,
                > {
                    self.entity(entity_id).stream(request).await
                }
            }
        }
    }
}
