//! Keeps glibc's `memcpy` off `rep movsb` on AMD CPUs where that instruction is slow.
//!
//! glibc before 2.39 copies 2,112 bytes to 512 KiB (the L2) with `rep movsb` on every CPU that
//! reports FSRM. AMD's Zen 3 and later do, and there `rep movsb` runs 15-20 times slower when
//! the destination sits 1-31 bytes past the source modulo 4 KiB (glibc bug 30994; measured on a
//! Zen 3 EPYC, 16 KiB copies: 1.7-2.1 GB/s against 29-38 GB/s at other distances). rustls
//! copies every received TLS record's plaintext (16 KiB) from an offset of 5 into a fresh
//! buffer, which lands on that distance often: in a profile of the KV transfer it took 274
//! samples with glibc's choice and 26 without it. glibc 2.39 stopped choosing `rep movsb` on
//! these CPUs; older ones take the choice from `GLIBC_TUNABLES`, which is read only when a
//! process starts. So `tl` sets it and starts itself again, once, before anything else runs.
//!
//! An operator's own `glibc.cpu.x86_rep_movsb_threshold` is left as it is: setting it to 2112
//! keeps glibc's default.

use std::ffi::OsString;

/// The tunable this module sets.
pub const TUNABLE: &str = "glibc.cpu.x86_rep_movsb_threshold";

/// The threshold set: above any L2 (glibc's upper bound for `rep movsb`), so no copy uses it.
pub const THRESHOLD: usize = 64 << 20;

/// Set in the environment of the process started again, so it never starts itself a third
/// time (for instance where the loader drops `GLIBC_TUNABLES`, as it does for setuid programs).
const MARKER: &str = "TL_REP_MOVSB_REEXEC";

/// What the decision rests on: read from the CPU, the C library and the environment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Inputs {
    /// `vendor_id` is `AuthenticAMD` and the flags list `fsrm`.
    pub amd_fsrm: bool,
    /// glibc's version as (major, minor); `None` off glibc or when unreadable.
    pub glibc: Option<(u32, u32)>,
    /// `GLIBC_TUNABLES` as this process received it.
    pub tunables: Option<String>,
    /// Whether this process was already started again by [`reexec_if_needed`].
    pub reexecuted: bool,
}

/// The `GLIBC_TUNABLES` value to start again with, or `None` to leave the process as it is.
pub fn tunables_to_set(i: &Inputs) -> Option<String> {
    if i.reexecuted || !i.amd_fsrm {
        return None;
    }
    if i.glibc.is_none_or(|v| v >= (2, 39)) {
        return None;
    }
    let setting = format!("{TUNABLE}={THRESHOLD}");
    match i.tunables.as_deref().map(str::trim) {
        None | Some("") => Some(setting),
        // The operator chose a threshold: theirs stands.
        Some(t) if t.split(':').any(|kv| kv.split('=').next() == Some(TUNABLE)) => None,
        Some(t) => Some(format!("{t}:{setting}")),
    }
}

/// Parses "2.36" (or "2.36.1") into (2, 36).
fn parse_version(v: &str) -> Option<(u32, u32)> {
    let mut parts = v.trim().split('.');
    let major = parts.next()?.parse().ok()?;
    let minor = parts.next()?.parse().ok()?;
    Some((major, minor))
}

/// Whether `/proc/cpuinfo` text names an AMD CPU that reports FSRM.
fn amd_with_fsrm(cpuinfo: &str) -> bool {
    let field = |k: &str| {
        cpuinfo
            .lines()
            .find(|l| l.split(':').next().is_some_and(|n| n.trim() == k))
            .and_then(|l| l.split_once(':'))
            .map(|(_, v)| v.trim())
    };
    field("vendor_id") == Some("AuthenticAMD")
        && field("flags").is_some_and(|f| f.split_whitespace().any(|x| x == "fsrm"))
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[allow(unsafe_code)]
fn glibc_version() -> Option<(u32, u32)> {
    // SAFETY: gnu_get_libc_version takes no arguments and returns a pointer to a static,
    // NUL-terminated string that lives as long as the process.
    let v = unsafe { std::ffi::CStr::from_ptr(libc::gnu_get_libc_version()) };
    parse_version(v.to_str().ok()?)
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn glibc_version() -> Option<(u32, u32)> {
    None
}

fn inputs() -> Inputs {
    let cpuinfo = if cfg!(target_arch = "x86_64") {
        std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default()
    } else {
        String::new()
    };
    Inputs {
        amd_fsrm: amd_with_fsrm(&cpuinfo),
        glibc: glibc_version(),
        tunables: std::env::var("GLIBC_TUNABLES").ok(),
        reexecuted: std::env::var_os(MARKER).is_some(),
    }
}

/// Starts this program again with the tunable set, when [`tunables_to_set`] says so. Call it
/// first in `main`, before any thread starts. Returns only when nothing was done or the exec
/// failed, in which case the process goes on with glibc's choice.
pub fn reexec_if_needed() {
    let Some(tunables) = tunables_to_set(&inputs()) else {
        return;
    };
    #[cfg(unix)]
    {
        use std::os::unix::process::CommandExt;
        let mut args = std::env::args_os();
        let arg0 = args.next().unwrap_or_else(|| OsString::from("tl"));
        // The program's own path, so the process keeps its name ("tl" in ps, top and the
        // kernel's comm); /proc/self/exe only when that path is gone (a binary replaced under a
        // running process), where the name becomes "exe".
        let exe = std::env::current_exe()
            .ok()
            .filter(|p| p.is_file())
            .unwrap_or_else(|| "/proc/self/exe".into());
        // The same PID, file descriptors and arguments: only the environment gains two names.
        let err = std::process::Command::new(exe)
            .arg0(arg0)
            .args(args)
            .env("GLIBC_TUNABLES", tunables)
            .env(MARKER, "1")
            .exec();
        eprintln!("tl: could not start again with {TUNABLE} set ({err}); going on without it");
    }
}

/// For benchmark output: the C library and whether this process set the threshold.
pub fn state_json() -> serde_json::Value {
    let i = inputs();
    let threshold = i.tunables.as_deref().and_then(|t| {
        t.split(':')
            .find_map(|kv| kv.strip_prefix(TUNABLE)?.strip_prefix('='))
            .map(str::to_owned)
    });
    serde_json::json!({
        "glibc": i.glibc.map(|(a, b)| format!("{a}.{b}")),
        "rep_movsb_threshold": threshold,
        "set_by_tl": i.reexecuted,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn zen3(tunables: Option<&str>) -> Inputs {
        Inputs {
            amd_fsrm: true,
            glibc: Some((2, 36)),
            tunables: tunables.map(str::to_owned),
            reexecuted: false,
        }
    }

    #[test]
    fn an_amd_cpu_with_fsrm_on_an_older_glibc_gets_the_threshold() {
        assert_eq!(
            tunables_to_set(&zen3(None)).as_deref(),
            Some("glibc.cpu.x86_rep_movsb_threshold=67108864")
        );
        assert_eq!(
            tunables_to_set(&zen3(Some(""))).as_deref(),
            Some("glibc.cpu.x86_rep_movsb_threshold=67108864")
        );
    }

    #[test]
    fn other_tunables_are_kept_and_an_operators_threshold_stands() {
        assert_eq!(
            tunables_to_set(&zen3(Some("glibc.malloc.arena_max=2"))).as_deref(),
            Some("glibc.malloc.arena_max=2:glibc.cpu.x86_rep_movsb_threshold=67108864")
        );
        assert_eq!(
            tunables_to_set(&zen3(Some(
                "glibc.malloc.arena_max=2:glibc.cpu.x86_rep_movsb_threshold=2112"
            ))),
            None
        );
        // A tunable whose name merely starts the same way is not the operator's threshold.
        assert!(tunables_to_set(&zen3(Some("glibc.cpu.x86_rep_movsb_threshold_x=1"))).is_some());
    }

    #[test]
    fn nothing_changes_elsewhere_or_twice() {
        let newer = Inputs {
            glibc: Some((2, 39)),
            ..zen3(None)
        };
        assert_eq!(tunables_to_set(&newer), None);
        let not_glibc = Inputs {
            glibc: None,
            ..zen3(None)
        };
        assert_eq!(tunables_to_set(&not_glibc), None);
        let intel = Inputs {
            amd_fsrm: false,
            ..zen3(None)
        };
        assert_eq!(tunables_to_set(&intel), None);
        let again = Inputs {
            reexecuted: true,
            ..zen3(None)
        };
        assert_eq!(tunables_to_set(&again), None);
    }

    #[test]
    fn cpuinfo_and_versions_are_read_as_glibc_and_the_kernel_write_them() {
        let amd = "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nflags\t\t: fpu erms fsrm avx2\n";
        assert!(amd_with_fsrm(amd));
        assert!(!amd_with_fsrm(&amd.replace(" fsrm", "")));
        assert!(!amd_with_fsrm(&amd.replace("AuthenticAMD", "GenuineIntel")));
        assert!(!amd_with_fsrm(""));
        assert_eq!(parse_version("2.36"), Some((2, 36)));
        assert_eq!(parse_version("2.39.1"), Some((2, 39)));
        assert_eq!(parse_version("2"), None);
        assert_eq!(parse_version("x.y"), None);
    }
}
