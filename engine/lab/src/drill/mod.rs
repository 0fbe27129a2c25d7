//! `tl drill`: failover drills. One gateway over a prefill and two decode engines
//! ([`single`]), or several gateways sharing the registry on etcd ([`fleet`]), each driving
//! streaming clients while a fault is injected and undone, every request checked against a
//! colocated run. Each prints one JSON line; exit 0 only when nothing was lost or failed.

use std::process::ExitCode;

use crate::run::{block_on, print_json};

pub mod args;
pub mod error;
mod fleet;
mod parts;
pub mod report;
mod single;

pub use args::{DrillArgs, Fault};
pub use error::DrillError;
pub use report::Report;

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
            fleet::run(args).await.map(|r| Report::Fleet(Box::new(r)))
        } else {
            single::run(args).await.map(|r| Report::Single(Box::new(r)))
        };
        match ran {
            Ok(report) => {
                let passed = report.passed();
                let code = print_json(Ok::<_, String>(report));
                if passed { code } else { ExitCode::from(1) }
            }
            Err(e) => print_json(Err::<Report, _>(e)),
        }
    })
}
