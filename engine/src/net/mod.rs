//! Networking shared by the node and the gateway.
//!
//! | job | file |
//! |---|---|
//! | servers and long-lived tasks under one shutdown mechanism, with TLS and header deadlines | [`server`] |
//! | clients of the other processes: EngineControl, the registry, HTTP | [`clients`] |
//! | outgoing connections that check the server's role | [`dial`] |
//! | the `[tls]` section, and rustls and tonic configurations | [`tls`] |
//! | who a peer is: `spiffe://tl/ROLE/ID` | [`identity`] |
//! | the library under rustls, and secure random bytes | [`crypto`] |
//! | `tl certs`: a development CA and role certificates | [`certs`] |
//! | who may call what, by the caller's role | [`authz`] |
//! | a worker's role in its three spellings | [`role`] |
//! | `[limits]`: what one peer may take | [`limits`] |
//! | `/livez`, `/readyz` and `POST /drain` beside `/metrics` | [`probes`] |
//! | connections that have not yet proven who they are | [`unproven`] |

pub mod authz;
pub mod certs;
pub mod clients;
pub mod crypto;
pub mod dial;
pub mod identity;
pub mod limits;
pub mod probes;
pub mod role;
pub mod server;
pub mod tls;
pub mod unproven;

/// True when `addr` (`host:port`) listens on loopback only: 127.0.0.0/8, `::1` or `localhost`.
#[must_use]
pub fn is_loopback_listen(addr: &str) -> bool {
    if let Ok(sa) = addr.parse::<std::net::SocketAddr>() {
        return sa.ip().is_loopback();
    }
    addr.rsplit_once(':')
        .is_some_and(|(host, _)| host.eq_ignore_ascii_case("localhost"))
}

/// The address peers reach a server bound at `bound` on: `advertise` (a host) with the bound
/// port, or the bound address itself.
///
/// # Errors
/// When the bound address is unspecified (`0.0.0.0`, `::`) and no advertise address is set:
/// peers cannot reach "anywhere".
pub fn advertised(bound: std::net::SocketAddr, advertise: &str) -> std::io::Result<String> {
    if !advertise.is_empty() {
        return Ok(if advertise.contains(':') && !advertise.starts_with('[') {
            format!("[{advertise}]:{}", bound.port())
        } else {
            format!("{advertise}:{}", bound.port())
        });
    }
    if bound.ip().is_unspecified() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("listening on {bound} needs an advertise address (--advertise-address)"),
        ));
    }
    Ok(bound.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_and_advertised_addresses() {
        for (addr, lo) in [
            ("127.0.0.1:0", true),
            ("127.9.9.9:80", true),
            ("[::1]:5", true),
            ("localhost:1", true),
            ("0.0.0.0:0", false),
            ("10.0.0.1:1", false),
            ("[::]:1", false),
            ("example.com:1", false),
        ] {
            assert_eq!(is_loopback_listen(addr), lo, "{addr}");
        }
        let any: std::net::SocketAddr = "0.0.0.0:7000".parse().unwrap();
        assert!(advertised(any, "").is_err());
        assert_eq!(advertised(any, "10.1.2.3").unwrap(), "10.1.2.3:7000");
        assert_eq!(advertised(any, "fd00::1").unwrap(), "[fd00::1]:7000");
        assert_eq!(
            advertised(any, "engine-0.svc").unwrap(),
            "engine-0.svc:7000"
        );
        let lo: std::net::SocketAddr = "127.0.0.1:9".parse().unwrap();
        assert_eq!(advertised(lo, "").unwrap(), "127.0.0.1:9");
    }
}
