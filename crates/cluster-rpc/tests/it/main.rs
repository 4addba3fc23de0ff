//! Integration tests of the TCP transport: a real server on 127.0.0.1 (port 0) with a fake
//! `RunnerHandler`, and `TcpTransport` (or a raw socket) as the client.

mod calls;
mod faults;
mod limits;
mod security;
mod support;
#[cfg(feature = "tls")]
mod tls;
