//! Connections that have not yet proven anything: a TLS handshake in progress, or an HTTP
//! connection that has not delivered one whole request. A listener at its cap closes the
//! oldest of them to admit a new connection, instead of refusing every newcomer, so a flood of
//! silent or trickling connections only ever displaces itself; and one source may hold at most
//! its share of them, its own oldest going first.

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::sync::{Arc, Mutex, PoisonError};

use tokio::task::AbortHandle;

/// The unproven connections of one listener, oldest first.
#[derive(Debug, Default)]
pub struct Unproven {
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    next: u64,
    by_age: BTreeMap<u64, (IpAddr, AbortHandle)>,
    per_ip: HashMap<IpAddr, usize>,
}

impl Inner {
    fn remove(&mut self, id: u64) -> Option<AbortHandle> {
        let (ip, handle) = self.by_age.remove(&id)?;
        if let Some(n) = self.per_ip.get_mut(&ip) {
            *n -= 1;
            if *n == 0 {
                self.per_ip.remove(&ip);
            }
        }
        Some(handle)
    }
}

/// A connection's entry: dropping it (the connection proved itself, or ended) takes it out.
#[derive(Debug)]
pub struct Entry {
    set: Arc<Unproven>,
    id: u64,
}

impl Drop for Entry {
    fn drop(&mut self) {
        self.set.lock().remove(self.id);
    }
}

impl Unproven {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Makes room for a new unproven connection from `ip`. When `ip` already holds `per_ip`
    /// of them, its own oldest is closed; else, when the listener is `full`, the oldest of any
    /// source is. Returns false when the listener is full and nothing could be closed: the
    /// newcomer must be refused.
    pub fn make_room(&self, ip: IpAddr, per_ip: usize, full: bool) -> bool {
        let mut g = self.lock();
        if g.per_ip.get(&ip).copied().unwrap_or(0) >= per_ip.max(1) {
            let own = g
                .by_age
                .iter()
                .find(|(_, (i, _))| *i == ip)
                .map(|(id, _)| *id);
            if let Some(h) = own.and_then(|id| g.remove(id)) {
                h.abort();
                return true;
            }
        }
        if !full {
            return true;
        }
        let oldest = g.by_age.keys().next().copied();
        match oldest.and_then(|id| g.remove(id)) {
            Some(h) => {
                h.abort();
                true
            }
            None => false,
        }
    }

    /// Enters the connection whose task `handle` aborts, from `ip`.
    pub fn enter(self: &Arc<Self>, ip: IpAddr, handle: AbortHandle) -> Entry {
        let mut g = self.lock();
        let id = g.next;
        g.next += 1;
        g.by_age.insert(id, (ip, handle));
        *g.per_ip.entry(ip).or_default() += 1;
        Entry {
            set: Arc::clone(self),
            id,
        }
    }

    /// Unproven connections now.
    #[must_use]
    pub fn len(&self) -> usize {
        self.lock().by_age.len()
    }

    /// True when there are none.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_oldest_goes_first_and_a_source_displaces_only_itself() {
        let set = Arc::new(Unproven::default());
        let (a, b): (IpAddr, IpAddr) = ("10.0.0.1".parse().unwrap(), "10.0.0.2".parse().unwrap());
        let mut tasks = Vec::new();
        let mut entries = Vec::new();
        for ip in [a, a, b] {
            let t = tokio::spawn(std::future::pending::<()>());
            entries.push(set.enter(ip, t.abort_handle()));
            tasks.push(t);
        }
        // a at its share of 2: its own oldest is closed, b's is not.
        assert!(set.make_room(a, 2, false));
        assert!(tasks.remove(0).await.unwrap_err().is_cancelled());
        assert_eq!(set.len(), 2);
        // The listener full: the oldest of any source goes (a's second).
        assert!(set.make_room(b, 8, true));
        assert!(tasks.remove(0).await.unwrap_err().is_cancelled());
        assert_eq!(set.len(), 1);
        // A connection that proves itself leaves the set: nothing left to close when full.
        entries.clear();
        assert!(set.is_empty());
        assert!(!set.make_room(b, 8, true));
        assert!(set.make_room(b, 8, false));
        tasks[0].abort();
    }
}
