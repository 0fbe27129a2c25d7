//! `tl role --engine HOST:PORT --role prefill|decode|both`: an operator moves an engine of role
//! both to another role (EngineControl.SetRole, admin or gateway certificates under mutual
//! TLS). Waits up to `--wait-ms` for the work of the role it left to end, and prints one JSON
//! line: `{"engine":...,"serving":[...],"remaining":N}`. Exit 0 when the engine took the role
//! (whatever remains), 1 when it refused or could not be reached.

use std::process::ExitCode;
use std::time::Duration;

use tl_engine::net::clients::ControlClient;
use tl_engine::net::role::Role;
use tl_engine::net::tls::Tls;

use crate::run::{TlsArgs, block_on, print_json};

/// Arguments of `tl role`.
#[derive(clap::Args, Debug)]
pub(crate) struct RoleArgs {
    /// The engine's EngineControl address.
    #[arg(long)]
    engine: String,
    /// The role it takes new work in from now on.
    #[arg(long)]
    role: Role,
    /// How long to wait for the work of the role it leaves to end, ms (0: answer at once).
    #[arg(long, default_value_t = 30_000)]
    wait_ms: u64,
    #[command(flatten)]
    tls: TlsArgs,
}

/// Runs `tl role`.
#[must_use]
pub(crate) fn role(args: &RoleArgs) -> ExitCode {
    block_on(async {
        print_json(
            async {
                let tls = args.tls.load()?;
                let client_tls = tls.as_ref().map(Tls::tonic_client);
                let ctl = ControlClient::with_tls(&args.engine, client_tls.as_ref())
                    .map_err(|e| e.to_string())?;
                let wait = i64::try_from(args.wait_ms).unwrap_or(i64::MAX);
                let deadline = Duration::from_millis(args.wait_ms) + Duration::from_secs(5);
                let r = tokio::time::timeout(deadline, ctl.set_role(args.role, wait))
                    .await
                    .map_err(|_| format!("{} did not answer within {deadline:?}", args.engine))?
                    .map_err(|s| format!("{:?}: {}", s.code(), s.message()))?;
                Ok::<_, String>(serde_json::json!({
                    "engine": args.engine,
                    "serving": r.serving,
                    "remaining": r.remaining,
                }))
            }
            .await,
        )
    })
}
