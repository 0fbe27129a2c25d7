//! Tenants: who a request belongs to, and the cache scope its KV blocks live in.
//!
//! A request's tenant is its API key, or, behind a trusted front, the value of
//! `[gateway] tenant_header`. Its cache scope is a keyed digest of the tenant and the request's
//! `cache_salt`: engines cache, find, report and deduplicate blocks only within one scope
//! (spec/block-identity.md), so two tenants never share a block, a HasBlocks answer or a dedup,
//! and one tenant's requests share as before. Scope 0 is the shared scope: every request of a
//! `shared_cache` deployment (one tenant for everyone) without a salt.
//!
//! The digest is HMAC-SHA-256 under a per-deployment secret (`cache_scope_secret_file`, else
//! random at start), truncated to 64 bits. Scopes never leave the internal network, but a keyed
//! digest also means no one, not even a tenant who can name another tenant (a guessable header
//! value), can search offline for a `cache_salt` that lands on another tenant's scope.

use ring::hmac;

/// Who called, as the key middleware found it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EndUser {
    /// The tenant: the API key, or the trusted tenant header's value (empty: no tenant, an
    /// unauthenticated public endpoint).
    pub tenant: Vec<u8>,
    /// An admin key: sees routing internals (`tl_route`) and `/workers`.
    pub admin: bool,
}

/// Requests and tokens in flight per tenant, bounded: one key cannot take every slot of the
/// gateway, nor, with a token bound, every block of the decode pools.
#[derive(Debug, Default)]
pub struct Quotas {
    limit: usize,
    token_limit: u64,
    held: std::sync::Mutex<std::collections::HashMap<Vec<u8>, (usize, u64)>>,
}

/// One request's place in its tenant's quota, given back on drop.
#[derive(Debug)]
pub struct Held {
    quotas: std::sync::Arc<Quotas>,
    tenant: Vec<u8>,
    /// Places it holds (a list of k prompts holds k).
    requests: usize,
    tokens: u64,
}

/// Which bound a request met.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OverQuota {
    /// `max_inflight_per_key`.
    Requests,
    /// `max_tokens_in_flight_per_key`.
    Tokens,
}

impl Quotas {
    /// At most `limit` requests in flight per tenant, and (when `token_limit` > 0) at most
    /// `token_limit` tokens: each request counts its prompt plus every token it may generate.
    #[must_use]
    pub fn new(limit: usize, token_limit: u64) -> Self {
        Self {
            limit: limit.max(1),
            token_limit,
            held: std::sync::Mutex::default(),
        }
    }

    fn map(&self) -> std::sync::MutexGuard<'_, std::collections::HashMap<Vec<u8>, (usize, u64)>> {
        self.held
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A place for `tenant`'s request of `tokens`, or which bound it meets. A tenant holding
    /// nothing may always start one request, however many tokens, so a large request is slow
    /// to admit, never refused for ever. The empty tenant (every caller without a key of a
    /// public gateway) is one tenant like the others: it is never exempt.
    ///
    /// # Errors
    /// The bound the request would pass.
    pub fn take(
        self: &std::sync::Arc<Self>,
        tenant: &[u8],
        tokens: u64,
    ) -> Result<Held, OverQuota> {
        {
            let mut m = self.map();
            let (n, held) = m.entry(tenant.to_vec()).or_default();
            if *n >= self.limit {
                return Err(OverQuota::Requests);
            }
            if self.token_limit > 0 && *n > 0 && held.saturating_add(tokens) > self.token_limit {
                return Err(OverQuota::Tokens);
            }
            *n += 1;
            *held = held.saturating_add(tokens);
        }
        Ok(Held {
            quotas: std::sync::Arc::clone(self),
            tenant: tenant.to_vec(),
            requests: 1,
            tokens,
        })
    }

    /// Requests `tenant` has in flight (what the tests check).
    #[cfg(test)]
    fn held_by(&self, tenant: &[u8]) -> usize {
        self.map().get(tenant).map_or(0, |h| h.0)
    }

    /// Tokens `tenant` has in flight.
    #[must_use]
    pub fn tokens_held_by(&self, tenant: &[u8]) -> u64 {
        self.map().get(tenant).map_or(0, |h| h.1)
    }
}

impl Held {
    /// Counts `requests` more requests and `tokens` more tokens against the tenant, once the
    /// request's size is known (its prompts tokenized): a request of k prompts takes k places,
    /// as the gateway's own limiter counts it. On refusal nothing is added.
    ///
    /// # Errors
    /// The bound the request would pass. Its first place stays held until dropped.
    pub fn grow(&mut self, requests: usize, tokens: u64) -> Result<(), OverQuota> {
        let q = std::sync::Arc::clone(&self.quotas);
        let mut m = q.map();
        let (n, held) = m.entry(self.tenant.clone()).or_default();
        if n.saturating_add(requests) > q.limit {
            return Err(OverQuota::Requests);
        }
        // Only this request in flight: it is admitted whatever its size.
        let alone = *n == self.requests;
        if q.token_limit > 0 && !alone && held.saturating_add(tokens) > q.token_limit {
            return Err(OverQuota::Tokens);
        }
        *n += requests;
        *held = held.saturating_add(tokens);
        self.requests += requests;
        self.tokens = self.tokens.saturating_add(tokens);
        Ok(())
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        let mut m = self.quotas.map();
        if let Some((n, tokens)) = m.get_mut(&self.tenant) {
            *n = n.saturating_sub(self.requests);
            *tokens = tokens.saturating_sub(self.tokens);
            if *n == 0 {
                m.remove(&self.tenant);
            }
        }
    }
}

/// The longest `cache_salt` taken (400 beyond).
pub const MAX_CACHE_SALT: usize = 256;

/// Derives cache scopes.
pub struct Scopes {
    key: hmac::Key,
    shared: bool,
}

impl std::fmt::Debug for Scopes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scopes")
            .field("shared", &self.shared)
            .finish_non_exhaustive()
    }
}

impl Scopes {
    /// Scopes under `secret`; with `shared`, every tenant is one (only the salt separates).
    #[must_use]
    pub fn new(secret: &[u8], shared: bool) -> Self {
        Self {
            key: hmac::Key::new(hmac::HMAC_SHA256, secret),
            shared,
        }
    }

    /// The scope of `tenant`'s request with `salt`: 0 for a shared deployment without a salt,
    /// else a 64-bit digest that is never 0.
    #[must_use]
    pub fn scope(&self, tenant: &[u8], salt: Option<&str>) -> u64 {
        let tenant = if self.shared { &[][..] } else { tenant };
        let salt = salt.unwrap_or("");
        if tenant.is_empty() && salt.is_empty() {
            return 0;
        }
        let mut ctx = hmac::Context::with_key(&self.key);
        // Length-prefixed, so no (tenant, salt) pair reads as another.
        ctx.update(b"tl.cache-scope.v1");
        ctx.update(&(tenant.len() as u64).to_le_bytes());
        ctx.update(tenant);
        ctx.update(&(salt.len() as u64).to_le_bytes());
        ctx.update(salt.as_bytes());
        let tag = ctx.sign();
        let mut first = [0u8; 8];
        first.copy_from_slice(&tag.as_ref()[..8]);
        u64::from_le_bytes(first).max(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quotas_bound_requests_and_tokens_per_tenant() {
        let q = std::sync::Arc::new(Quotas::new(3, 100));
        let a1 = q.take(b"a", 60).unwrap();
        assert_eq!(q.take(b"a", 50).unwrap_err(), OverQuota::Tokens);
        let a2 = q.take(b"a", 40).unwrap();
        assert_eq!(q.tokens_held_by(b"a"), 100);
        // Another tenant is not touched by a's use.
        let b = q.take(b"b", 500).unwrap();
        assert_eq!(q.take(b"b", 1).unwrap_err(), OverQuota::Tokens);
        drop(a1);
        assert_eq!(q.tokens_held_by(b"a"), 40);
        let a3 = q.take(b"a", 60).unwrap();
        let a4 = q.take(b"a", 0).unwrap();
        assert_eq!(q.take(b"a", 0).unwrap_err(), OverQuota::Requests);
        drop((a2, a3, a4, b));
        assert_eq!((q.held_by(b"a"), q.tokens_held_by(b"a")), (0, 0));
        // The empty tenant (keyless callers of a public gateway) is bounded like any other.
        let e1 = q.take(b"", 0).unwrap();
        let e2 = q.take(b"", 0).unwrap();
        let e3 = q.take(b"", 0).unwrap();
        assert_eq!(q.take(b"", 0).unwrap_err(), OverQuota::Requests);
        drop((e1, e2, e3));
        assert_eq!(q.held_by(b""), 0);
        // No token bound configured: only the count.
        let open = std::sync::Arc::new(Quotas::new(1, 0));
        let _x = open.take(b"a", u64::MAX).unwrap();
        assert_eq!(open.take(b"a", 1).unwrap_err(), OverQuota::Requests);
    }

    #[test]
    fn scopes_separate_tenants_and_salts_and_nothing_else() {
        let s = Scopes::new(b"secret", false);
        let a = s.scope(b"key-a", None);
        assert_eq!(a, s.scope(b"key-a", None), "one tenant shares with itself");
        assert_ne!(a, s.scope(b"key-b", None));
        assert_ne!(a, s.scope(b"key-a", Some("x")));
        // The boundary between tenant and salt is not movable.
        assert_ne!(s.scope(b"ab", Some("c")), s.scope(b"a", Some("bc")));
        assert_ne!(a, 0);
        assert_eq!(s.scope(b"", None), 0, "no tenant, no salt: shared");
        // Another deployment's secret gives other scopes.
        assert_ne!(a, Scopes::new(b"other", false).scope(b"key-a", None));
        // One tenant for everyone: keys no longer separate, salts still do.
        let one = Scopes::new(b"secret", true);
        assert_eq!(one.scope(b"key-a", None), 0);
        assert_eq!(one.scope(b"key-b", None), 0);
        assert_ne!(one.scope(b"key-a", Some("x")), 0);
    }
}
