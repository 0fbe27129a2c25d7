//! Hosts of the drill's own, on one machine: a Linux network namespace per engine, joined by
//! veth pairs (`ip netns`, `ip link`; root only). Removed on drop.
//!
//! ```text
//!   root namespace (gateway)        10.N.(k+1).254  <-- veth -->  10.N.(k+1).1   engine k
//!   prefill (k = 0)                 10.N.(10+i).1   <-- veth -->  10.N.(10+i).2  decode i (k = i+1)
//! ```
//!
//! Every engine reaches the gateway over its own link, and the prefill engine reaches decode
//! engine i over a link of their own (a /32 route sends its traffic for decode i's address
//! there), so no packet is forwarded between interfaces (Docker's firewall drops forwarded
//! traffic on such hosts). Cutting that link partitions exactly the KV transfer path.

use std::process::{Command, Stdio};

use crate::drill::error::DrillError;

/// Namespaces: 0 the prefill engine, 1 and 2 the decode engines.
pub(crate) const ENGINES: usize = 3;

/// The namespaces and links of one drill.
#[derive(Debug)]
pub struct Netns {
    tag: String,
    net: u8,
    made: Vec<String>,
}

fn ip(args: &[&str]) -> Result<(), DrillError> {
    let what = format!("ip {}", args.join(" "));
    let out = Command::new("ip")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| DrillError::Process {
            what: what.clone(),
            why: e.to_string(),
        })?;
    if out.status.success() {
        Ok(())
    } else {
        Err(DrillError::Process {
            what,
            why: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        })
    }
}

impl Netns {
    /// Creates the namespaces and links; an error says why they cannot be made here.
    pub fn create() -> Result<Self, DrillError> {
        let pid = std::process::id();
        let mut n = Self {
            tag: format!("tl{}", pid % 100_000),
            net: 100 + (pid % 100) as u8,
            made: Vec::new(),
        };
        for k in 0..ENGINES {
            let ns = n.ns(k);
            ip(&["netns", "add", &ns])?;
            n.made.push(ns.clone());
            let (host, inner) = (format!("{}h{k}", n.tag), format!("{}n{k}", n.tag));
            ip(&["link", "add", &host, "type", "veth", "peer", "name", &inner])?;
            ip(&["link", "set", &inner, "netns", &ns])?;
            ip(&["addr", "add", &format!("{}/24", n.root_ip(k)), "dev", &host])?;
            ip(&["link", "set", &host, "up"])?;
            n.exec_ip(
                k,
                &[
                    "addr",
                    "add",
                    &format!("{}/24", n.engine_ip(k)),
                    "dev",
                    &inner,
                ],
            )?;
            n.exec_ip(k, &["link", "set", &inner, "up"])?;
            n.exec_ip(k, &["link", "set", "lo", "up"])?;
        }
        for i in 0..ENGINES - 1 {
            let (p_end, d_end) = (n.p_end(i), n.d_end(i));
            ip(&[
                "link", "add", &p_end, "type", "veth", "peer", "name", &d_end,
            ])?;
            ip(&["link", "set", &p_end, "netns", &n.ns(0)])?;
            ip(&["link", "set", &d_end, "netns", &n.ns(i + 1)])?;
            let sub = 10 + i;
            n.exec_ip(
                0,
                &[
                    "addr",
                    "add",
                    &format!("10.{}.{sub}.1/24", n.net),
                    "dev",
                    &p_end,
                ],
            )?;
            n.exec_ip(0, &["link", "set", &p_end, "up"])?;
            n.exec_ip(
                i + 1,
                &[
                    "addr",
                    "add",
                    &format!("10.{}.{sub}.2/24", n.net),
                    "dev",
                    &d_end,
                ],
            )?;
            n.exec_ip(i + 1, &["link", "set", &d_end, "up"])?;
            // The prefill engine reaches decode i's address over their own link.
            let to = format!("{}/32", n.engine_ip(i + 1));
            let via = format!("10.{}.{sub}.2", n.net);
            n.exec_ip(0, &["route", "replace", &to, "via", &via, "dev", &p_end])?;
        }
        Ok(n)
    }

    fn ns(&self, k: usize) -> String {
        format!("{}-{k}", self.tag)
    }

    fn p_end(&self, i: usize) -> String {
        format!("{}p{i}", self.tag)
    }

    fn d_end(&self, i: usize) -> String {
        format!("{}d{i}", self.tag)
    }

    fn exec_ip(&self, k: usize, args: &[&str]) -> Result<(), DrillError> {
        let ns = self.ns(k);
        let mut all = vec!["netns", "exec", &ns, "ip"];
        all.extend_from_slice(args);
        ip(&all)
    }

    /// Engine k's address (what it listens on and advertises).
    pub fn engine_ip(&self, k: usize) -> String {
        format!("10.{}.{}.1", self.net, k + 1)
    }

    /// The root namespace's address on engine k's link (where the gateway's registry is).
    pub fn root_ip(&self, k: usize) -> String {
        format!("10.{}.{}.254", self.net, k + 1)
    }

    /// The command prefix that runs a program in engine k's namespace.
    pub fn exec(&self, k: usize) -> Vec<String> {
        vec!["ip".into(), "netns".into(), "exec".into(), self.ns(k)]
    }

    /// Cuts the link between the prefill engine and decode engine i at the decode end: the
    /// prefill side keeps its route, so its packets vanish (a partition, not a refusal).
    pub fn cut(&self, i: usize) -> Result<(), DrillError> {
        self.exec_ip(i + 1, &["link", "set", &self.d_end(i), "down"])
    }

    /// Mends what [`cut`](Self::cut) cut.
    pub fn mend(&self, i: usize) -> Result<(), DrillError> {
        self.exec_ip(i + 1, &["link", "set", &self.d_end(i), "up"])
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        // Deleting a namespace deletes the veth ends inside it, and with them their peers.
        for ns in &self.made {
            let _ = ip(&["netns", "del", ns]);
        }
    }
}
