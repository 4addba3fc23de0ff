//! The user API: what application code writes and calls.
//!
//! - `entity`: the entity traits, `Protocol`, the contexts and `EntityOptions`;
//! - `rpc`: request types (`Rpc`, `StreamRpc`) and `CallError`;
//! - `client`: `EntityClient`, the typed client of one entity;
//! - `queue_entity`: entities that drain their requests and answer them in any order;
//! - `state`: durable entity state, kept across activations and committed with the reply.
//!
//! Nothing here names the runtime's type: the contexts hold it erased, and the runtime adds
//! the methods that hand it out.

pub(crate) mod client;
pub(crate) mod entity;
pub(crate) mod erased;
pub(crate) mod queue_entity;
pub(crate) mod rpc;
pub(crate) mod state;
