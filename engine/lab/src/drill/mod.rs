//! `tl drill`: failover drills. One gateway over a prefill and two decode engines
//! ([`single`]), or several gateways sharing the registry on etcd ([`fleet`]), each driving
//! streaming clients while a fault is injected and undone, every request checked against a
//! colocated run. Each prints one JSON line; exit 0 only when nothing was lost or failed.

use std::process::ExitCode;

use serde_json::Value;

use crate::run::{block_on, print_json};

pub mod args;
pub mod error;
mod fleet;
mod parts;
mod single;

pub use args::{DrillArgs, Fault};
pub use error::DrillError;

/// Runs `tl drill`.
#[must_use]
pub fn drill(args: &DrillArgs) -> ExitCode {
    block_on(async {
        let fleet = args.gateways > 1
            || matches!(
                args.fault,
                Fault::GatewayKill | Fault::EtcdKill | Fault::EtcdDown
            );
        let ran = if fleet {
            fleet::run(args).await
        } else {
            single::run(args).await
        };
        match ran {
            Ok((v, ok)) => {
                let code = print_json(Ok::<_, String>(v));
                if ok { code } else { ExitCode::from(1) }
            }
            Err(e) => print_json(Err::<Value, _>(e)),
        }
    })
}
