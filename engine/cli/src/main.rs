//! `tl`: one binary for every role of the kvwire engine; one file per command.

mod certs;
mod demo;
mod engine;
mod etcd;
mod fetch;
mod gateway;
mod generate;
mod inspect;
mod model;
mod probe;
mod registry;
mod role;
mod run;
mod serve;

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use tl_engine::telemetry::{LogFormat, init_logs};

#[derive(Parser, Debug)]
#[command(
    name = "tl",
    version,
    about = "kvwire engine: inspect envelopes, run engines, benchmark"
)]
struct Cli {
    /// Log lines on stderr as text or JSON; `RUST_LOG` filters them (default `info`).
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Validate a kv.wire.v1 envelope file and print its header and records.
    ///
    /// Exit status: 0 valid; 3 format refusal; 4 version refusal; 5 shape refusal; 2 usage or I/O.
    Inspect(inspect::InspectArgs),
    /// Serve a model the OpenAI way: the gateway and 1 prefill + 2 decode engines (or one
    /// colocated engine) in this process, over mutual TLS; prints the base URL and the model id,
    /// and drains on SIGTERM or Ctrl-C.
    Serve(serve::ServeArgs),
    /// Colocated generation on one engine; prints `{"tokens":[...],"seed":S}`.
    Generate(generate::GenerateArgs),
    /// A development CA (made on first use) and a role certificate signed by it; prints the paths.
    Certs(certs::CertsArgs),
    /// Registry, one prefill and two decode engines on loopback; requests sharing a system prompt,
    /// each checked against a colocated run. Exit 0 only if every request matched.
    Demo(demo::DemoArgs),
    /// The ops.01 failover drill: gateway, 1 prefill and 2 decode engines as processes under
    /// streaming load; one decode engine killed (or stopped) at T/3 and back at 2T/3. Prints
    /// one JSON line; exit 0 only if no request was lost or failed.
    Drill(tl_lab::drill::DrillArgs),
    /// Run an engine (prefill, decode or both) until SIGTERM.
    Engine(engine::EngineArgs),
    /// Run the gateway (OpenAI-compatible HTTP front and the worker registry) until SIGTERM.
    Gateway(gateway::GatewayArgs),
    /// One plain-HTTP request to a probe (`/livez`, `/readyz`, `POST /drain`) of a process's
    /// metrics listener; exit 0 on 200. For health checks and preStop hooks in the image.
    Probe(probe::ProbeArgs),
    /// Run a worker registry until SIGTERM.
    Registry(registry::RegistryArgs),
    /// Move an engine of role both to another role (EngineControl.SetRole); prints one JSON
    /// line with the roles it serves in and the work of the old role still in flight.
    Role(role::RoleArgs),
    /// The registry on etcd: `init` turns auth on, `grant` lets an identity in, `drain` asks a
    /// worker to drain.
    Etcd {
        #[command(subcommand)]
        which: etcd::EtcdCmd,
    },
    /// Model checkpoints: `tl model init` writes one with seeded random weights.
    Model {
        #[command(subcommand)]
        which: model::ModelCmd,
    },
    /// Benchmarks that print one JSON line.
    Bench {
        #[command(subcommand)]
        which: BenchCmd,
    },
}

#[derive(Subcommand, Debug)]
enum BenchCmd {
    /// Envelope read and write throughput against raw CRC-32C and memcpy, measured in the same run.
    Wire(tl_lab::bench::wire::WireArgs),
    /// KV transfer throughput over loopback gRPC against raw TCP, interleaved.
    Transfer(tl_lab::bench::transfer::TransferArgs),
    /// Time to first token, disaggregated (prefill, HasBlocks, push, resume) against colocated.
    Ttft(tl_lab::bench::ttft::TtftArgs),
    /// Load over loopback HTTP: the gateway over 1 prefill + 2 decode against one engine alone.
    Serve(tl_lab::bench::serve::ServeArgs),
    /// Info and HasBlocks latency, idle against while the engine decodes or imports.
    Control(tl_lab::bench::control::ControlArgs),
    /// One tenant against another: a light key beside a heavy one, and B's time to first token
    /// with and without A's prefix (Welch's t-test).
    Tenants(tl_lab::bench::tenants::TenantsArgs),
    /// The real transformer: decode tokens/s at batch 1, 8, 32 against the weight-streaming
    /// roofline, prefill against the kernels' matmul peak (SmolLM2-135M's shape).
    Model(tl_lab::bench::model::ModelArgs),
    /// Routing per request at 4, 16 and 64 decode engines, fan-out against the prefix index,
    /// and the prefix-hit rate through 1 gateway against 2.
    Route(tl_lab::bench::route::RouteArgs),
    /// DistServe's goodput on the same engines: the highest request rate at which 90% of
    /// requests meet a TTFT and a TPOT SLO, disaggregated against colocated, over a sweep.
    Goodput(tl_lab::bench::goodput::GoodputArgs),
}

/// Keeps glibc from handing multi-MiB buffers back to the kernel on every free.
///
/// Every KV message allocates a fresh 2 MiB buffer (tonic's encode and decode buffers, the
/// envelope) and frees it moments later. With glibc's defaults such buffers are mmapped and
/// unmapped each time, so every message faults in 512 fresh zeroed pages: measured here, that
/// halved transfer throughput (1.2 vs 2.2 GB/s on loopback). Serving the buffers from the heap
/// and not trimming it keeps them warm.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[allow(unsafe_code)]
fn keep_large_buffers_warm() {
    // SAFETY: mallopt only changes allocator parameters; it is called once, before any thread
    // is spawned, with documented parameter values.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 30);
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn keep_large_buffers_warm() {}

fn main() -> ExitCode {
    // A gateway's chat-template render process: no CLI, no logs, no allocator settings.
    if std::env::args_os().nth(1).as_deref()
        == Some(std::ffi::OsStr::new(
            tl_engine::gateway::sandbox::WORKER_ARG,
        ))
    {
        return tl_engine::gateway::sandbox::worker_main();
    }
    // Before any thread or allocation setting: this may start the program again.
    tl_engine::copies::reexec_if_needed();
    keep_large_buffers_warm();
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            let _ = e.print();
            // clap's own exit codes: 0 for --help/--version, 2 for usage errors.
            return ExitCode::from(if e.use_stderr() { 2 } else { 0 });
        }
    };
    // The servers start their own logs, with span export when configured.
    if !matches!(
        cli.cmd,
        Cmd::Engine(_) | Cmd::Gateway(_) | Cmd::Registry(_) | Cmd::Demo(_) | Cmd::Serve(_)
    ) {
        init_logs(cli.log_format);
    }
    match cli.cmd {
        Cmd::Inspect(args) => inspect::inspect(&args),
        Cmd::Generate(args) => generate::generate(&args),
        Cmd::Certs(args) => certs::certs(&args),
        Cmd::Demo(args) => demo::demo(&args, cli.log_format),
        Cmd::Serve(args) => serve::serve(&args, cli.log_format),
        Cmd::Drill(args) => tl_lab::drill::drill(&args),
        Cmd::Probe(args) => probe::probe(&args),
        Cmd::Engine(args) => engine::engine(&args, cli.log_format),
        Cmd::Registry(args) => registry::registry(&args, cli.log_format),
        Cmd::Role(args) => role::role(&args),
        Cmd::Model { which } => model::model(&which),
        Cmd::Etcd { which } => etcd::etcd(&which),
        Cmd::Gateway(args) => gateway::gateway(&args, cli.log_format),
        Cmd::Bench { which } => match which {
            BenchCmd::Wire(args) => tl_lab::bench::wire::wire(&args),
            BenchCmd::Transfer(args) => tl_lab::bench::transfer::transfer(&args),
            BenchCmd::Ttft(args) => tl_lab::bench::ttft::ttft(&args),
            BenchCmd::Serve(mut args) => {
                if args.peers {
                    args.peer_source = Some(fetch::resolve("smollm2"));
                }
                tl_lab::bench::serve::serve(&args)
            }
            BenchCmd::Control(args) => tl_lab::bench::control::control(&args),
            BenchCmd::Tenants(args) => tl_lab::bench::tenants::tenants(&args),
            BenchCmd::Model(mut args) => {
                if !args.no_peer {
                    match fetch::resolve(&args.peer) {
                        Ok(path) => args.peer = path,
                        Err(e) => args.peer_error = Some(e),
                    }
                }
                tl_lab::bench::model::model(&args)
            }
            BenchCmd::Route(args) => tl_lab::bench::route::route(&args),
            BenchCmd::Goodput(args) => tl_lab::bench::goodput::goodput(&args),
        },
    }
}
