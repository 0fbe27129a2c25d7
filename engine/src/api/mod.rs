//! The OpenAI-compatible HTTP API as types: requests, responses, stream chunks and errors, shared
//! by the gateway, the engines' decode front, the demo, the benches and the clients. [`sse`] is
//! the one server-sent-events codec.
//!
//! Extensions beyond OpenAI's fields: `top_k`, `seed` (echoed), `stop_token_ids`,
//! `choices[].tokens` (token ids), `choices[].tl_logprobs` (log-probabilities by token id),
//! and `tl_route` (where the gateway sent a request).

mod error;
pub mod logprobs;
pub mod render;
mod request;
mod response;
pub mod sse;
pub mod tools;

pub use self::error::*;
pub use self::request::*;
pub use self::response::*;
