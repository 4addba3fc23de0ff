//! Volatile requests between runners (`effect/src/cluster/Sharding.ts` `sendOutgoing`,
//! `effect/src/cluster/Runners.ts`): routing to the shard's owner through a
//! [`Transport`](cluster_core::transport::Transport), and the server side that a transport
//! calls when a peer's request arrives ([`Remote::handler`], handed out by
//! `Plumbing::runner_handler`).
//!
//! A volatile request goes to the owner of its shard in the current assignment: this runner
//! (the local path, which waits for a lock being taken over), another runner (through the
//! transport), or nobody yet. A transport failure (`RunnerUnavailable`) or a bounce
//! (`EntityNotAssignedToRunner`, the owner moved) is retried every `send_retry_interval` with
//! the owner looked up again, for at most `shard_lock_expiration`, after which the caller gets
//! the error; a runner that is shutting down does not retry. Dropping the caller's future drops
//! the transport call, which interrupts the request on the owner.
//!
//! Persisted requests are stored first and need no transport: the owner reads them.
//! With one, the caller pushes a stored request to its owner ([`Remote::push`]), which runs it
//! without waiting for a read and answers with the final reply it stored
//! ([`PushedRequests`]).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, OnceLock, Weak};

use cluster_core::envelope::{AckChunk, Envelope, Exit, Reply, Request, WithExit};
use cluster_core::future::BoxFuture;
use cluster_core::sync::lock;
use cluster_core::transport::{ReplyStream, RunnerHandler, Transport};
use cluster_core::{ClusterError, RunnerAddress, ShardId, ShardingConfig, Snowflake};
use tokio::sync::{mpsc, oneshot};
use tokio_util::task::TaskTracker;

use crate::api::entity::Ids;
use crate::placement::shards::Shards;
use crate::runtime::delivery::{Delivery, ReadLatch, ReplyTo};
use crate::runtime::interrupt::InterruptSignal;
use crate::runtime::local::{LocalCall, LocalDelivery, STREAM_BUFFER, StreamCall};
use crate::runtime::registry::Managers;

/// Where a volatile request goes.
enum Route {
    /// To an entity of this process.
    Local,
    /// To another runner.
    Remote(RunnerAddress),
    /// Nowhere yet: no owner is known (no assignment was published).
    Unknown,
    /// Nowhere it can reach: the owner is another runner and there is no transport.
    Unreachable,
}

/// Routing of volatile requests, to this runner or another, and the server side of the
/// transport.
pub(crate) struct Remote {
    /// This runner's address (`None` in a client).
    own: Option<RunnerAddress>,
    /// How long a volatile request is retried for (`shard_lock_expiration`).
    retry_for: std::time::Duration,
    /// The pause between retries (`send_retry_interval`).
    retry_every: std::time::Duration,
    transport: Option<Arc<dyn Transport>>,
    shards: Arc<Shards>,
    local: Arc<LocalDelivery>,
    managers: Arc<Managers>,
    ids: Arc<Ids>,
    /// Wakes the storage read loop when a peer says a message was stored for a shard here.
    read_latch: Arc<ReadLatch>,
    /// Volatile requests of remote callers running here.
    calls: RemoteCalls,
    /// Where persisted requests pushed by their callers go: persisted delivery, once it
    /// started (weak: persisted delivery holds this routing).
    pushed: OnceLock<Weak<dyn PushedRequests>>,
    /// The runtime's tasks: the stream pumps and the owner notices.
    tasks: TaskTracker,
}

/// What routing works with, besides its settings.
pub(crate) struct RemoteParts {
    pub(crate) transport: Option<Arc<dyn Transport>>,
    pub(crate) shards: Arc<Shards>,
    pub(crate) local: Arc<LocalDelivery>,
    pub(crate) managers: Arc<Managers>,
    pub(crate) ids: Arc<Ids>,
    pub(crate) read_latch: Arc<ReadLatch>,
    pub(crate) tasks: TaskTracker,
}

/// Volatile requests of remote callers still running here, by request id: where their
/// interrupts and acknowledgements go.
#[derive(Default)]
struct RemoteCalls {
    calls: Mutex<BTreeMap<Snowflake, RemoteCall>>,
}

struct RemoteCall {
    cancellation: InterruptSignal,
    acks: Option<mpsc::Sender<Snowflake>>,
}

impl RemoteCalls {
    fn insert(&self, request_id: Snowflake, call: RemoteCall) {
        lock(&self.calls).insert(request_id, call);
    }

    fn remove(&self, request_id: Snowflake) {
        lock(&self.calls).remove(&request_id);
    }

    fn interrupt(&self, request_id: Snowflake) {
        if let Some(call) = lock(&self.calls).get(&request_id) {
            call.cancellation.cancel();
        }
    }

    fn ack(&self, request_id: Snowflake, reply_id: Snowflake) {
        if let Some(acks) = lock(&self.calls).get(&request_id).and_then(|call| call.acks.clone()) {
            // Full only if the caller acknowledged faster than chunks went out.
            let _ = acks.try_send(reply_id);
        }
    }
}

/// What serves the persisted requests that callers push to this runner (persisted delivery).
///
/// A pushed request was stored by its caller already.
/// Storage stays the source of truth: a request that is not served here is read from storage
/// by its owner, and its caller reads the reply from storage.
pub(crate) trait PushedRequests: Send + Sync {
    /// Runs the stored unary `request` here, in its entity's storage order, and answers with its
    /// final reply once that is stored.
    ///
    /// `EntityNotAssignedToRunner` when this runner does not serve its shard, or stops waiting
    /// for the reply (shutdown).
    fn serve(self: Arc<Self>, request: Request) -> BoxFuture<'static, Result<Reply, ClusterError>>;

    /// Takes up the stored streaming `request` (the read loop delivers it, in order) and answers
    /// with its chunks and final reply, each once stored.
    ///
    /// `EntityNotAssignedToRunner` when this runner does not serve its shard.
    fn serve_stream(
        self: Arc<Self>,
        request: Request,
    ) -> Result<Box<dyn ReplyStream>, ClusterError>;

    /// Takes up a stored `envelope` without answering: a discarded request runs as
    /// [`serve`](PushedRequests::serve) runs it; an interrupt or acknowledgement goes to its
    /// request if that runs here.
    fn take_up(self: Arc<Self>, envelope: Envelope);
}

/// The error of a request whose entity is not on this runner (yet).
fn not_here<T>(request: &Request) -> Result<T, ClusterError> {
    Err(ClusterError::EntityNotAssignedToRunner { address: request.address.clone() })
}

impl Remote {
    /// Routing with `parts`, as `config` says (its runner address, `shard_lock_expiration`,
    /// `send_retry_interval`).
    pub(crate) fn new(config: &ShardingConfig, parts: RemoteParts) -> Remote {
        let RemoteParts { transport, shards, local, managers, ids, read_latch, tasks } = parts;
        Remote {
            own: config.runner_address.clone(),
            retry_for: config.shard_lock_expiration,
            retry_every: config.send_retry_interval,
            transport,
            shards,
            local,
            managers,
            ids,
            read_latch,
            calls: RemoteCalls::default(),
            pushed: OnceLock::new(),
            tasks,
        }
    }

    /// Serves the persisted requests that callers push here with `pushed`. Set once.
    pub(crate) fn serve_pushed_with(&self, pushed: Weak<dyn PushedRequests>) {
        if self.pushed.set(pushed).is_err() {
            tracing::error!("pushed requests were given a server twice; the first is kept");
        }
    }

    /// The server of pushed persisted requests, if persisted delivery runs.
    fn pushed(&self) -> Option<Arc<dyn PushedRequests>> {
        self.pushed.get().and_then(Weak::upgrade)
    }

    /// Sends a stored persisted request to its shard's owner, through the transport
    /// (the reference's persisted `Effect` RPC).
    ///
    /// - The owner runs it without waiting for a read of storage.
    /// - It answers with the final reply it stored.
    /// - `None` when the owner is this runner, unknown, or out of reach: the caller waits on
    ///   storage.
    ///
    /// A failed call (`Err`) tells the caller nothing about the request: it stays stored.
    pub(crate) fn push(
        &self,
        request: &Request,
    ) -> Option<BoxFuture<'static, Result<Reply, ClusterError>>> {
        let (owner, transport) = self.pushed_to(request)?;
        let request = request.clone();
        Some(Box::pin(async move { transport.send(&owner, request, true).await }))
    }

    /// [`Remote::push`] for a streaming request: the owner answers with the chunks and the final
    /// reply it stores, as it stores them.
    pub(crate) fn push_stream(
        &self,
        request: &Request,
    ) -> Option<BoxFuture<'static, Result<Box<dyn ReplyStream>, ClusterError>>> {
        let (owner, transport) = self.pushed_to(request)?;
        let request = request.clone();
        Some(Box::pin(async move { transport.stream(&owner, request, true).await }))
    }

    /// The owner of `request`'s shard and the transport to it, when that is another runner.
    fn pushed_to(&self, request: &Request) -> Option<(RunnerAddress, Arc<dyn Transport>)> {
        let Route::Remote(owner) = self.route(&request.address.shard_id) else { return None };
        Some((owner, self.transport.clone()?))
    }

    /// The runner-to-runner transport, if any.
    pub(crate) fn transport(&self) -> Option<&Arc<dyn Transport>> {
        self.transport.as_ref()
    }

    /// The owner of `shard` for volatile traffic.
    fn route(&self, shard: &ShardId) -> Route {
        let Some(cluster) = self.shards.member() else {
            return if self.shards.is_runner() { Route::Local } else { Route::Unreachable };
        };
        let me = self.own.as_ref();
        match cluster.owner(shard) {
            Some(owner) if Some(&owner) == me => Route::Local,
            Some(owner) if self.transport().is_some() => Route::Remote(owner),
            Some(_) => Route::Unreachable,
            None => Route::Unknown,
        }
    }

    /// Whether a failed volatile send may be tried again (the deadline of the whole call is
    /// checked by the caller).
    fn retriable(&self, error: &ClusterError) -> bool {
        !self.shards.shutdown().is_cancelled()
            && matches!(
                error,
                ClusterError::RunnerUnavailable { .. }
                    | ClusterError::EntityNotAssignedToRunner { .. }
            )
    }

    /// Runs a volatile request where its route leads: `local` on this runner, `remote` on
    /// another. Bounces and transport failures are tried again every `send_retry_interval`
    /// with the owner looked up again, for at most `shard_lock_expiration`.
    async fn routed<T, Local, LocalFuture, Remote, RemoteFuture>(
        &self,
        request: Request,
        what: &'static str,
        local: Local,
        remote: Remote,
    ) -> Result<T, ClusterError>
    where
        Local: FnOnce(Request) -> LocalFuture,
        LocalFuture: std::future::Future<Output = Result<T, ClusterError>>,
        Remote: Fn(RunnerAddress, Request) -> RemoteFuture,
        RemoteFuture: std::future::Future<Output = Result<T, ClusterError>>,
    {
        let mut deadline = None;
        loop {
            let route = self.route(&request.address.shard_id);
            // The common case first, with no clock read and no waiting: a shard held here.
            if matches!(route, Route::Local) && self.shards.delivers(&request.address.shard_id) {
                return local(request).await;
            }
            let deadline = *deadline.get_or_insert_with(|| crate::time::deadline(self.retry_for));
            // The rarer steps are boxed, so that the common case's future stays small.
            let attempt = match route {
                // A stale assignment may name this runner for a shard it does not hold (it
                // has not seen a join yet): the owner is looked up again.
                Route::Local
                    if Box::pin(self.shards.await_shard(&request.address.shard_id)).await =>
                {
                    return local(request).await;
                }
                Route::Local | Route::Unknown => not_here(&request),
                Route::Remote(owner) => Box::pin(remote(owner, request.clone())).await,
                Route::Unreachable => return not_here(&request),
            };
            match attempt {
                Err(error) if self.retriable(&error) && tokio::time::Instant::now() < deadline => {
                    tracing::debug!(%error, request_id = %request.request_id, what, "volatile request not delivered; retrying");
                    tokio::time::sleep(self.retry_every).await;
                }
                attempt => return attempt,
            }
        }
    }

    /// Sends a volatile request to its entity, wherever it lives, and waits for its exit.
    ///
    /// The common case, a registered entity in a shard held here, is handed over without a
    /// future of its own (the routing loop's is about 2 KiB, and a future is copied into its
    /// parent when it is made); anything else goes through [`routed`](Sharding::routed),
    /// boxed. Either way a local delivery's error is the call's, as in `routed`.
    pub(crate) async fn send(
        &self,
        request: Request,
        uninterruptible: bool,
    ) -> Result<Exit, ClusterError> {
        let shard = &request.address.shard_id;
        let request = if matches!(self.route(shard), Route::Local) && self.shards.delivers(shard) {
            let (delivery, call) = LocalCall::new(request);
            match self.local.deliver_registered(delivery) {
                Ok(Ok(())) => return call.exit(uninterruptible).await,
                Ok(Err(refused)) => return Err(refused),
                // Not registered yet: the routing loop waits for the registration.
                Err(unregistered) => unregistered.request,
            }
        } else {
            request
        };
        Box::pin(self.routed(
            request,
            "request",
            |request| self.local.send(request, uninterruptible),
            |owner, request| self.send_remote(owner, request, uninterruptible),
        ))
        .await
    }

    async fn send_remote(
        &self,
        owner: RunnerAddress,
        request: Request,
        uninterruptible: bool,
    ) -> Result<Exit, ClusterError> {
        let Some(transport) = self.transport.clone() else {
            return Err(ClusterError::EntityNotAssignedToRunner { address: request.address });
        };
        let call = async move { transport.send(&owner, request, false).await };
        let reply = if uninterruptible {
            // Dropping the caller must not drop the call (which would interrupt it remotely):
            // it runs on as a task of the runtime, awaited at shutdown.
            let task = self.tasks.spawn(call);
            task.await
                .map_err(|_| ClusterError::RunnerUnavailable { address: self.own_address() })?
        } else {
            call.await
        }?;
        match reply {
            Reply::WithExit(with_exit) => Ok(with_exit.exit),
            Reply::Chunk(_) => {
                Ok(crate::api::entity::malformed("a chunk answered a unary request"))
            }
        }
    }

    /// This runner's address, or an empty one for a client (only for errors).
    fn own_address(&self) -> RunnerAddress {
        self.own.clone().unwrap_or_else(|| RunnerAddress::new("", 0))
    }

    /// Delivers a volatile request without waiting for its exit (a discarded call).
    pub(crate) async fn notify(&self, request: Request) -> Result<(), ClusterError> {
        self.routed(
            request,
            "discard",
            |request| self.local.notify(request),
            |owner, request| async move {
                match &self.transport {
                    Some(transport) => {
                        transport.notify(&owner, Envelope::Request(request), false).await
                    }
                    None => not_here(&request),
                }
            },
        )
        .await
    }

    /// Sends a volatile streaming request to its entity, wherever it lives: its replies, where
    /// the caller's acknowledgements go, and what interrupts it.
    pub(crate) async fn stream(&self, request: Request) -> Result<StreamCall, ClusterError> {
        self.routed(
            request,
            "stream",
            |request| self.local.stream(request),
            |owner, request| self.stream_remote(owner, request),
        )
        .await
    }

    async fn stream_remote(
        &self,
        owner: RunnerAddress,
        request: Request,
    ) -> Result<StreamCall, ClusterError> {
        let Some(transport) = self.transport.clone() else {
            return Err(ClusterError::EntityNotAssignedToRunner { address: request.address });
        };
        let address = request.address.clone();
        let request_id = request.request_id;
        let mut stream = transport.stream(&owner, request, false).await?;
        let (replies, replied) = mpsc::channel(STREAM_BUFFER);
        let (acked, mut acks) = mpsc::channel::<Snowflake>(STREAM_BUFFER);
        let cancellation = InterruptSignal::new();
        // The replies are pumped until the final one, the caller goes away or interrupts, or the
        // runtime shuts down: a task of the runtime's, awaited at shutdown.
        let stop = cancellation.clone();
        let shutdown = self.shards.shutdown().token().clone();
        self.tasks.spawn(async move {
            loop {
                let next = tokio::select! {
                    next = stream.next_reply() => next,
                    () = stop.cancelled() => return,
                    () = shutdown.cancelled() => return,
                };
                let Some(reply) = next else { return };
                let reply = match reply {
                    Ok(reply) => reply,
                    // The call was cut: the caller hears the stream ended early.
                    Err(error) => {
                        tracing::debug!(%error, %request_id, "remote stream failed");
                        return;
                    }
                };
                let last = reply.is_final();
                if replies.send(reply).await.is_err() || last {
                    return;
                }
            }
        });
        // Acknowledgements go to the owner as `AckChunk` envelopes, until the caller drops its
        // stream or the runtime shuts down.
        let ids = Arc::clone(&self.ids);
        let shutdown = self.shards.shutdown().token().clone();
        self.tasks.spawn(async move {
            loop {
                let reply_id = tokio::select! {
                    next = acks.recv() => match next {
                        Some(reply_id) => reply_id,
                        None => return,
                    },
                    () = shutdown.cancelled() => return,
                };
                let ack =
                    AckChunk { id: ids.next(), address: address.clone(), request_id, reply_id };
                if let Err(error) =
                    transport.send_envelope(&owner, Envelope::AckChunk(ack), false).await
                {
                    tracing::debug!(%error, %request_id, "could not send an acknowledgement");
                }
            }
        });
        Ok((replied, acked, cancellation))
    }

    /// A message for `shard` was stored: whoever reads that shard looks at once. That is this
    /// runner's read loop, or the owner's, told through the transport (the reference's
    /// persisted `Notify`; a failure is only logged, the owner's poll finds the message
    /// anyway).
    pub(crate) fn wake_reader(&self, shard: &ShardId, envelope: impl FnOnce() -> Envelope) {
        self.read_latch.wake();
        let Route::Remote(owner) = self.route(shard) else { return };
        let Some(transport) = self.transport.clone() else { return };
        let envelope = envelope();
        self.tasks.spawn(async move {
            if let Err(error) = transport.notify(&owner, envelope, true).await {
                tracing::debug!(%error, %owner, "could not tell the owner to read storage");
            }
        });
    }

    /// What a transport calls when a peer's request arrives (the reference's `RunnerServer`).
    /// It does not keep the runtime alive.
    pub(crate) fn handler(self: &Arc<Remote>) -> Arc<dyn RunnerHandler> {
        Arc::new(Server { remote: Arc::downgrade(self) })
    }
}

/// The server side of this runtime, for a transport.
struct Server {
    remote: std::sync::Weak<Remote>,
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RunnerServer").finish_non_exhaustive()
    }
}

impl Server {
    /// The runtime's routing, unless the runtime is gone (then the request's entity is not
    /// here).
    fn remote(&self, address: &cluster_core::EntityAddress) -> Result<Arc<Remote>, ClusterError> {
        self.remote
            .upgrade()
            .ok_or_else(|| ClusterError::EntityNotAssignedToRunner { address: address.clone() })
    }
}

impl RunnerHandler for Server {
    fn notify(
        &self,
        envelope: Envelope,
        persisted: bool,
    ) -> BoxFuture<'_, Result<(), ClusterError>> {
        Box::pin(async move {
            let remote = self.remote(envelope.address())?;
            if persisted {
                // Stored already: taken up at once, or by the read loop.
                match remote.pushed() {
                    Some(pushed) => pushed.take_up(envelope),
                    None => remote.read_latch.wake(),
                }
                return Ok(());
            }
            match envelope {
                Envelope::Request(request) => remote.local.notify(request).await,
                Envelope::Interrupt(interrupt) => {
                    remote.calls.interrupt(interrupt.request_id);
                    Ok(())
                }
                Envelope::AckChunk(ack) => {
                    remote.calls.ack(ack.request_id, ack.reply_id);
                    Ok(())
                }
            }
        })
    }

    fn request(
        &self,
        request: Request,
        persisted: bool,
    ) -> BoxFuture<'_, Result<Box<dyn ReplyStream>, ClusterError>> {
        Box::pin(async move {
            let remote = self.remote(&request.address)?;
            let request_id = request.request_id;
            let is_stream = remote
                .managers
                .get(&request.address.entity_type)
                .is_some_and(|manager| manager.is_stream(&request.tag));
            if persisted {
                // Stored by its caller already: it runs here, and its stored replies go back on
                // this call.
                return match remote.pushed() {
                    Some(pushed) if is_stream => pushed.serve_stream(request),
                    Some(pushed) => {
                        let reply = pushed.serve(request);
                        Ok(Box::new(ServerStream::Pushed { reply: Some(reply) })
                            as Box<dyn ReplyStream>)
                    }
                    None => {
                        remote.read_latch.wake();
                        Err(ClusterError::EntityNotAssignedToRunner { address: request.address })
                    }
                };
            }
            if is_stream {
                let (replies, acks, cancellation) = remote.local.stream(request).await?;
                let call = RemoteCall { cancellation: cancellation.clone(), acks: Some(acks) };
                remote.calls.insert(request_id, call);
                let guard = CallGuard { remote: Arc::downgrade(&remote), request_id, cancellation };
                Ok(Box::new(ServerStream::Stream { replies, _guard: guard })
                    as Box<dyn ReplyStream>)
            } else {
                let (reply, exit) = oneshot::channel();
                let cancellation = InterruptSignal::new();
                let call = RemoteCall { cancellation: cancellation.clone(), acks: None };
                remote.calls.insert(request_id, call);
                let guard = CallGuard {
                    remote: Arc::downgrade(&remote),
                    request_id,
                    cancellation: cancellation.clone(),
                };
                remote
                    .local
                    .deliver(Delivery::volatile(request, cancellation, ReplyTo::Exit(reply)))
                    .await?;
                let id = remote.ids.next();
                Ok(
                    Box::new(ServerStream::Unary {
                        exit: Some(exit),
                        request_id,
                        id,
                        _guard: guard,
                    }) as Box<dyn ReplyStream>,
                )
            }
        })
    }

    fn envelope(
        &self,
        envelope: Envelope,
        persisted: bool,
    ) -> BoxFuture<'_, Result<(), ClusterError>> {
        self.notify(envelope, persisted)
    }
}

/// Interrupts a remote caller's request when its reply stream is dropped (the caller went
/// away), and forgets it.
struct CallGuard {
    remote: std::sync::Weak<Remote>,
    request_id: Snowflake,
    cancellation: InterruptSignal,
}

impl Drop for CallGuard {
    fn drop(&mut self) {
        self.cancellation.cancel();
        if let Some(remote) = self.remote.upgrade() {
            remote.calls.remove(self.request_id);
        }
    }
}

/// The replies of a remote caller's request.
enum ServerStream {
    Unary {
        exit: Option<oneshot::Receiver<Exit>>,
        request_id: Snowflake,
        id: Snowflake,
        _guard: CallGuard,
    },
    Stream {
        replies: mpsc::Receiver<Reply>,
        _guard: CallGuard,
    },
    /// A pushed persisted request: its stored final reply.
    /// Dropped (the caller went away), the request keeps running: it is stored, and only a
    /// stored interrupt stops it.
    Pushed {
        reply: Option<BoxFuture<'static, Result<Reply, ClusterError>>>,
    },
}

impl ReplyStream for ServerStream {
    fn next_reply(&mut self) -> BoxFuture<'_, Option<Result<Reply, ClusterError>>> {
        Box::pin(async move {
            match self {
                ServerStream::Unary { exit, request_id, id, .. } => {
                    let exit = exit.take()?;
                    let exit = exit.await.unwrap_or_else(|_| Exit::interrupt());
                    Some(Ok(Reply::WithExit(WithExit { request_id: *request_id, id: *id, exit })))
                }
                ServerStream::Stream { replies, .. } => replies.recv().await.map(Ok),
                ServerStream::Pushed { reply } => Some(reply.take()?.await),
            }
        })
    }
}
