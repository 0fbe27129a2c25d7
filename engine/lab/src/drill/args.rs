//! `tl drill`'s arguments and the faults it injects.

/// What happens to the decode engine at T/3.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Fault {
    /// `kill -9`; a fresh process under the same id at 2T/3.
    Kill,
    /// `SIGSTOP` (a hung engine: the stall timeout fails its streams over); `SIGCONT` at 2T/3.
    Sigstop,
    /// `docker network disconnect` of the container (with `--compose`), or a cut of the link
    /// between the prefill engine and the decode engine (with `--netns`); mended at 2T/3.
    Partition,
    /// The gateway (and with it the registry) killed with `kill -9` and started again at once
    /// on the same addresses: the engines re-register; work it had in flight on the engines
    /// is freed (streams cancelled, unclaimed handles by their lease).
    RegistryRestart,
    /// With `--gateways 2`: one gateway killed with `kill -9` under load, started again at 2T/3.
    GatewayKill,
    /// With `--gateways 2`: one of three etcd members killed, started again at 2T/3.
    EtcdKill,
    /// With `--gateways 2`: every etcd member stopped from T/3 to 2T/3; gateways route on their
    /// last snapshot (`[registry] stale_ms`) and engines keep serving.
    EtcdDown,
}

/// Arguments of `tl drill`.
#[derive(clap::Args, Debug)]
pub struct DrillArgs {
    /// Concurrent streaming clients.
    #[arg(long, default_value_t = 8)]
    pub(crate) clients: usize,
    /// Seconds of load.
    #[arg(long, default_value_t = 15.0)]
    pub(crate) seconds: f64,
    /// What happens to the decode engine at T/3.
    #[arg(long, value_enum, default_value_t = Fault::Kill)]
    pub(crate) fault: Fault,
    /// Tokens per request.
    #[arg(long, default_value_t = 24)]
    pub(crate) max_tokens: u32,
    /// Simulated decode cost per sequence per step, in microseconds (so streams are in flight
    /// when the fault lands).
    #[arg(long, default_value_t = 1500)]
    pub(crate) decode_us: u64,
    /// Run against `deploy/compose.yaml`'s containers (`docker kill` / `docker pause`) instead
    /// of processes; the image must exist (deploy/build-image.sh).
    #[arg(long)]
    pub(crate) compose: bool,
    /// Run the processes in network namespaces of their own (root only): each engine on its
    /// own address, the prefill engine reaching each decode engine over a link that
    /// `--fault partition` cuts.
    #[arg(long, conflicts_with = "compose")]
    pub netns: bool,
    /// The image `--compose` runs.
    #[arg(long, default_value = "kvwire-tl:dev")]
    pub(crate) image: String,
    /// The etcd image `--compose` runs (deploy/build-etcd-image.sh).
    #[arg(long, default_value = "kvwire-etcd:dev")]
    pub(crate) etcd_image: String,
    /// The gateway's stall timeout, in milliseconds (processes; the compose file sets its own).
    #[arg(long, default_value_t = 1000)]
    pub(crate) stall_ms: u64,
    /// The output is always one JSON line; accepted for scripts that ask for it.
    #[arg(long)]
    pub json: bool,
    /// Heartbeat interval of the engines, in milliseconds.
    #[arg(long, default_value_t = 200)]
    pub(crate) heartbeat_ms: u32,
    /// Gateways over the same engines, sharing the registry on etcd (processes only): the
    /// faults gateway-kill, etcd-kill and etcd-down need 2.
    #[arg(long, default_value_t = 1)]
    pub(crate) gateways: usize,
}
