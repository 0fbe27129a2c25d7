//! Real-time scheduling for the control plane's threads: the crate's one use of unsafe code,
//! because rustix does not offer `sched_setscheduler`.

/// Puts the calling thread under `SCHED_FIFO` at `priority` (1..=99). On Linux a scheduling
/// policy is a thread's own, so only this thread changes.
///
/// # Errors
/// When the kernel refuses (no `CAP_SYS_NICE` and an `RLIMIT_RTPRIO` below `priority`: EPERM),
/// or off Linux.
#[allow(unsafe_code)]
pub fn set_fifo(priority: u8) -> std::io::Result<()> {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: sched_param is a plain C struct of integers, for which all-zero is valid.
        let mut param: libc::sched_param = unsafe { std::mem::zeroed() };
        param.sched_priority = i32::from(priority);
        // SAFETY: `param` is initialised and outlives the call, which only reads it; pid 0 is
        // the calling thread.
        let r = unsafe { libc::sched_setscheduler(0, libc::SCHED_FIFO, &raw const param) };
        if r == 0 {
            Ok(())
        } else {
            Err(std::io::Error::last_os_error())
        }
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = priority;
        Err(std::io::Error::new(
            std::io::ErrorKind::Unsupported,
            "SCHED_FIFO is set on Linux only",
        ))
    }
}

/// Whether the calling thread runs under `SCHED_FIFO`.
#[allow(unsafe_code)]
#[must_use]
pub fn is_fifo() -> bool {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: sched_getscheduler takes a pid (0: the calling thread) and touches no memory.
        unsafe { libc::sched_getscheduler(0) == libc::SCHED_FIFO }
    }
    #[cfg(not(target_os = "linux"))]
    {
        false
    }
}

#[cfg(test)]
mod tests {
    /// A thread that may take SCHED_FIFO has it afterwards; one that may not keeps its policy
    /// and gets an error. Either way no other thread changes.
    #[test]
    fn fifo_is_the_calling_threads_own() {
        let (set, on) = std::thread::spawn(|| {
            let set = super::set_fifo(1);
            (set.is_ok(), super::is_fifo())
        })
        .join()
        .unwrap();
        assert_eq!(set, on);
        assert!(!super::is_fifo(), "the test's own thread changed");
        #[cfg(target_os = "linux")]
        {
            // Priority 0 is not a SCHED_FIFO priority: refused whatever the privileges.
            let refused = std::thread::spawn(|| super::set_fifo(0).is_err())
                .join()
                .unwrap();
            assert!(refused);
        }
    }
}
