//! Networking shared by the node and the gateway: servers with one shutdown mechanism
//! ([`server`]), and the clients of the other processes ([`clients`]).

pub mod clients;
pub mod server;
pub mod tls;
