//! Raw TLS 1.3 (AES-128-GCM, ring) over loopback, one sender thread and one receiver thread,
//! 1 GiB in 2 MiB writes per run, against raw TCP in the same round:
//!
//! - `rustls 0.23, read`: the buffered API as tokio-rustls drives it. Each record is decrypted in
//!   place, copied into a `Vec` (`take_received_plaintext`), then copied into the reader's buffer.
//! - `rustls 0.23, fill_buf`: the same, but the receiver borrows the plaintext (`BufRead`), so
//!   only the first copy is left. h2 reads into a buffer of its own and cannot do this.
//! - `rustls 0.24, in place`: 0.24.0-dev.2's `MessageHandler::next_payload`, which yields the
//!   plaintext where it was decrypted, in the caller's receive buffer: no copy. Run with reads of
//!   up to 256 KiB and of one record (18 KiB), because 0.23 reads one record per `recv`.
//!
//! Both ends check every byte count; every payload's first and last byte are checked too.
use std::io::{BufRead, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::time::Instant;

const TOTAL: usize = 1 << 30;
const CHUNK: usize = 2 << 20;
const FILL: u8 = 7;

fn gbps(start: Instant) -> f64 {
    TOTAL as f64 / start.elapsed().as_secs_f64() / 1e9
}

fn check(payload: &[u8]) {
    if let (Some(&a), Some(&b)) = (payload.first(), payload.last()) {
        assert!(a == FILL && b == FILL, "plaintext changed");
    }
}

fn tcp() -> f64 {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = l.local_addr().expect("addr");
    let srv = std::thread::spawn(move || {
        let (mut s, _) = l.accept().expect("accept");
        let mut buf = vec![0u8; CHUNK];
        let mut got = 0;
        while got < TOTAL {
            let n = s.read(&mut buf).expect("read");
            assert!(n > 0, "early end of stream");
            check(&buf[..n]);
            got += n;
        }
        s.write_all(&[1]).expect("ack");
    });
    let mut c = TcpStream::connect(addr).expect("connect");
    c.set_nodelay(true).expect("nodelay");
    let chunk = vec![FILL; CHUNK];
    let start = Instant::now();
    for _ in 0..TOTAL / CHUNK {
        c.write_all(&chunk).expect("write");
    }
    let mut ack = [0u8];
    c.read_exact(&mut ack).expect("ack");
    let rate = gbps(start);
    srv.join().expect("receiver");
    rate
}

/// A CA and a server certificate for `localhost`, DER.
struct Certs {
    ca: Vec<u8>,
    cert: Vec<u8>,
    key: Vec<u8>,
}

fn certs() -> Certs {
    let ca_key = rcgen::KeyPair::generate().expect("CA key");
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("CA params");
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let ca = ca_params.self_signed(&ca_key).expect("CA cert");
    let key = rcgen::KeyPair::generate().expect("key");
    let params = rcgen::CertificateParams::new(vec!["localhost".to_string()]).expect("params");
    let cert = params
        .signed_by(&key, &rcgen::Issuer::new(ca_params, ca_key))
        .expect("cert");
    Certs {
        ca: ca.der().to_vec(),
        cert: cert.der().to_vec(),
        key: key.serialize_der(),
    }
}

#[derive(Clone, Copy)]
enum Recv {
    /// rustls 0.23's buffered API, read into the caller's buffer.
    Read23,
    /// rustls 0.23's buffered API, plaintext borrowed (`BufRead`).
    FillBuf23,
    /// rustls 0.24's in-place `next_payload`, socket reads of at most this many bytes.
    InPlace24(usize),
}

#[derive(Clone, Copy)]
enum Send {
    V23,
    V24,
}

/// Both versions' configurations, from one CA and server certificate.
struct Configs {
    server23: Arc<r23::ServerConfig>,
    client23: Arc<r23::ClientConfig>,
    server24: Arc<r24::ServerConfig>,
    client24: Arc<r24::ClientConfig>,
}

fn configs(c: &Certs) -> Configs {
    use r23::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
    let cert = || vec![CertificateDer::from(c.cert.clone())];
    let key = || PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(c.key.clone()));
    let p23 = Arc::new(r23::crypto::ring::default_provider());
    let server23 = r23::ServerConfig::builder_with_provider(p23.clone())
        .with_protocol_versions(&[&r23::version::TLS13])
        .expect("versions")
        .with_no_client_auth()
        .with_single_cert(cert(), key())
        .expect("server config");
    let mut roots = r23::RootCertStore::empty();
    roots.add(CertificateDer::from(c.ca.clone())).expect("root");
    let client23 = r23::ClientConfig::builder_with_provider(p23)
        .with_protocol_versions(&[&r23::version::TLS13])
        .expect("versions")
        .with_root_certificates(roots)
        .with_no_client_auth();
    let p24 = Arc::new(r24_ring::DEFAULT_TLS13_PROVIDER);
    let identity = r24::crypto::Identity::from_cert_chain(cert()).expect("identity");
    let server24 = r24::ServerConfig::builder(p24.clone())
        .with_no_client_auth()
        .with_single_cert(Arc::new(identity), key())
        .expect("server config");
    let mut roots = r24::RootCertStore::empty();
    roots.add(CertificateDer::from(c.ca.clone())).expect("root");
    let client24 = r24::ClientConfig::builder(p24)
        .with_root_certificates(roots)
        .with_no_client_auth()
        .expect("client config");
    Configs {
        server23: Arc::new(server23),
        client23: Arc::new(client23),
        server24: Arc::new(server24),
        client24: Arc::new(client24),
    }
}

/// The receive buffer rustls 0.24 decrypts in: each socket read appends, and what rustls has
/// consumed is dropped from the front (the rest moved down when the tail has no room for a read).
struct Input {
    buf: Vec<u8>,
    start: usize,
    end: usize,
    /// The most one socket read takes.
    read_max: usize,
}

impl Input {
    fn new(read_max: usize) -> Self {
        Input {
            buf: vec![0; read_max + (64 << 10)],
            start: 0,
            end: 0,
            read_max,
        }
    }

    fn fill(&mut self, s: &mut TcpStream) -> usize {
        if self.start == self.end {
            (self.start, self.end) = (0, 0);
        } else if self.buf.len() - self.end < self.read_max {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        let to = self.end + self.read_max;
        let n = s.read(&mut self.buf[self.end..to]).expect("read");
        self.end += n;
        n
    }
}

impl r24::TlsInputBuffer for Input {
    fn slice_mut(&mut self) -> &mut [u8] {
        &mut self.buf[self.start..self.end]
    }

    fn discard(&mut self, n: usize) {
        self.start += n;
    }

    fn received_close_notify(&mut self) {}

    fn has_seen_eof(&self) -> bool {
        false
    }
}

/// The receiving end: takes `TOTAL` bytes of plaintext, then sends a one-byte ack.
fn receive(mut s: TcpStream, cfg: &Configs, how: Recv) {
    let mut got = 0;
    match how {
        Recv::Read23 | Recv::FillBuf23 => {
            let conn = r23::ServerConnection::new(cfg.server23.clone()).expect("connection");
            let mut s = r23::StreamOwned::new(conn, s);
            let mut buf = vec![0u8; CHUNK];
            while got < TOTAL {
                let n = if let Recv::Read23 = how {
                    let n = s.read(&mut buf).expect("read");
                    check(&buf[..n]);
                    n
                } else {
                    let plain = s.fill_buf().expect("fill_buf");
                    check(plain);
                    let n = plain.len();
                    s.consume(n);
                    n
                };
                assert!(n > 0, "early end of stream");
                got += n;
            }
            s.write_all(&[1]).expect("ack");
            s.flush().expect("flush");
        }
        Recv::InPlace24(read_max) => {
            let mut conn = r24::Connection::<r24::ServerSide, r24::Tcp>::new(cfg.server24.clone())
                .expect("connection");
            let mut input = Input::new(read_max);
            let mut tls = Vec::new();
            while got < TOTAL {
                let n = input.fill(&mut s);
                assert!(n > 0, "early end of stream");
                let mut handler = conn.read_tls(&mut input, &mut tls);
                while let Some(payload) = handler.next_payload() {
                    let plain = payload.expect("record");
                    check(plain.bytes());
                    got += plain.bytes().len();
                }
                drop(handler);
                if !tls.is_empty() {
                    s.write_all(&tls).expect("write");
                    tls.clear();
                }
            }
            conn.write((&[1u8][..]).into(), &mut tls).expect("ack");
            s.write_all(&tls).expect("ack");
        }
    }
}

/// The sending end: handshakes (untimed), then sends `TOTAL` bytes in 2 MiB writes and waits
/// for the ack; returns GB/s.
fn send(mut sock: TcpStream, cfg: &Configs, how: Send) -> f64 {
    let chunk = vec![FILL; CHUNK];
    match how {
        Send::V23 => {
            let name = r23::pki_types::ServerName::try_from("localhost").expect("name");
            let conn = r23::ClientConnection::new(cfg.client23.clone(), name).expect("connection");
            let mut c = r23::StreamOwned::new(conn, sock);
            while c.conn.is_handshaking() {
                c.conn.complete_io(&mut c.sock).expect("handshake");
            }
            let start = Instant::now();
            for _ in 0..TOTAL / CHUNK {
                c.write_all(&chunk).expect("write");
            }
            c.flush().expect("flush");
            let mut ack = [0u8];
            c.read_exact(&mut ack).expect("ack");
            gbps(start)
        }
        Send::V24 => {
            let mut tls = Vec::new();
            let name = r24::pki_types::ServerName::try_from("localhost").expect("name");
            let mut conn = cfg
                .client24
                .connect(name)
                .build(&mut tls)
                .expect("connection");
            let mut input = Input::new(64 << 10);
            let mut received = Vec::new();
            loop {
                if !tls.is_empty() {
                    sock.write_all(&tls).expect("write");
                    tls.clear();
                }
                if !conn.is_handshaking() {
                    break;
                }
                assert!(input.fill(&mut sock) > 0, "end of stream in the handshake");
                conn.read_tls(&mut input, &mut tls)
                    .handle_all(&mut received)
                    .expect("handshake");
            }
            let start = Instant::now();
            for _ in 0..TOTAL / CHUNK {
                conn.write((&chunk[..]).into(), &mut tls).expect("seal");
                sock.write_all(&tls).expect("write");
                tls.clear();
            }
            while received.is_empty() {
                assert!(input.fill(&mut sock) > 0, "no ack");
                conn.read_tls(&mut input, &mut tls)
                    .handle_all(&mut received)
                    .expect("ack");
            }
            gbps(start)
        }
    }
}

fn tls(cfg: &Arc<Configs>, sender: Send, receiver: Recv) -> f64 {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = l.local_addr().expect("addr");
    let rcfg = Arc::clone(cfg);
    let srv = std::thread::spawn(move || {
        let (s, _) = l.accept().expect("accept");
        receive(s, &rcfg, receiver);
    });
    let sock = TcpStream::connect(addr).expect("connect");
    sock.set_nodelay(true).expect("nodelay");
    let rate = send(sock, cfg, sender);
    srv.join().expect("receiver");
    rate
}

fn cpu() -> String {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let field = |k: &str| {
        info.lines()
            .find(|l| l.starts_with(k))
            .and_then(|l| l.split(':').nth(1))
            .map_or(String::from("?"), |v| v.trim().to_owned())
    };
    format!(
        "{} (family {}, model {})",
        field("model name"),
        field("cpu family"),
        field("model\t")
    )
}

fn main() {
    let rounds: usize = std::env::args()
        .nth(1)
        .map_or(3, |a| a.parse().expect("rounds: a number"));
    let cfg = Arc::new(configs(&certs()));
    println!("cpu: {}", cpu());
    println!("GB/s, then over raw TCP of the same round; sender -> receiver");
    let cases = [
        ("0.23 -> 0.23 read", Send::V23, Recv::Read23),
        ("0.23 -> 0.23 fill_buf", Send::V23, Recv::FillBuf23),
        (
            "0.23 -> 0.24 in place (256K reads)",
            Send::V23,
            Recv::InPlace24(256 << 10),
        ),
        ("0.24 -> 0.23 read", Send::V24, Recv::Read23),
        (
            "0.24 -> 0.24 in place (256K reads)",
            Send::V24,
            Recv::InPlace24(256 << 10),
        ),
        (
            "0.24 -> 0.24 in place (18K reads)",
            Send::V24,
            Recv::InPlace24(18 << 10),
        ),
    ];
    for round in 1..=rounds {
        let t = tcp();
        let mut line = format!("round {round}: tcp {t:.2}");
        for (name, s, r) in cases {
            let g = tls(&cfg, s, r);
            line += &format!(" | {name} {g:.2} ({:.2})", g / t);
        }
        println!("{line}");
    }
}
