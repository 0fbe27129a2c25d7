//! A fleet in one process: a gateway, engines registered with its registry, and the wait until
//! every one of them is listed. `tl serve`, `tl demo`, the lab's benchmarks and the tests start
//! their fleets through [`FleetBuilder`], so one order holds everywhere: the gateway first (its
//! registry's address is only known once it listens), then each engine pointed at it, then a
//! bounded wait for their registrations.

use std::time::{Duration, Instant};

use crate::gateway::GatewayNode;
use crate::gateway::config::GatewayConfig;
use crate::node::EngineNode;
use crate::node::config::Config;

/// Why a fleet did not start.
#[derive(Debug, thiserror::Error)]
pub enum FleetError {
    /// The gateway could not start.
    #[error("the gateway did not start: {0}")]
    Gateway(#[source] std::io::Error),
    /// An engine could not start.
    #[error("engine {id} did not start: {source}")]
    Engine {
        /// The engine's id.
        id: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// Not every engine registered in time.
    #[error("{registered} of {expected} engines registered within {within:?}")]
    Registration {
        /// Engines listed when the wait ended.
        registered: usize,
        /// Engines started.
        expected: usize,
        /// How long the wait was.
        within: Duration,
    },
}

/// A gateway and its engines, running in this process.
pub struct LocalFleet {
    /// The gateway (its registry is the fleet's).
    pub gateway: GatewayNode,
    /// The engines, in the order they were added.
    pub engines: Vec<EngineNode>,
}

impl std::fmt::Debug for LocalFleet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalFleet")
            .field("gateway", &self.gateway.http_addr())
            .field("engines", &self.engines.len())
            .finish()
    }
}

/// What a [`LocalFleet`] is made of, before it starts.
#[derive(Debug)]
pub struct FleetBuilder {
    gateway: GatewayConfig,
    engines: Vec<Config>,
    register_within: Duration,
}

impl LocalFleet {
    /// A fleet behind a gateway configured by `gateway`.
    #[must_use]
    pub fn builder(gateway: GatewayConfig) -> FleetBuilder {
        FleetBuilder {
            gateway,
            engines: Vec::new(),
            register_within: Duration::from_secs(10),
        }
    }

    /// Drains each engine (up to `grace` each), then stops it, then the gateway. Returns the
    /// work the engines still held when their grace ran out.
    pub async fn stop(self, grace: Duration) -> usize {
        let mut remaining = 0;
        for e in self.engines {
            remaining += e.shutdown(grace).await;
        }
        self.gateway.stop().await;
        remaining
    }

    /// Stops every node at once (no drain): for a fleet that never served.
    async fn kill(self) {
        for e in self.engines {
            e.kill().await;
        }
        self.gateway.stop().await;
    }
}

impl FleetBuilder {
    /// Adds an engine. Its `engine.gateway_registry` is set to the fleet's gateway when the
    /// fleet starts.
    #[must_use]
    pub fn engine(mut self, cfg: Config) -> Self {
        self.engines.push(cfg);
        self
    }

    /// Adds engines, as [`Self::engine`] each.
    #[must_use]
    pub fn engines(mut self, cfgs: impl IntoIterator<Item = Config>) -> Self {
        self.engines.extend(cfgs);
        self
    }

    /// How long [`Self::start`] waits for every engine to be listed (default 10 s).
    #[must_use]
    pub fn register_within(mut self, within: Duration) -> Self {
        self.register_within = within;
        self
    }

    /// Starts the gateway, then every engine registering with it, and waits until the
    /// registry lists them all.
    ///
    /// # Errors
    /// A node that does not start (the nodes already started are stopped), or registrations
    /// that do not all arrive within the bound (the fleet is stopped).
    pub async fn start(self) -> Result<LocalFleet, FleetError> {
        let gateway = GatewayNode::start(&self.gateway)
            .await
            .map_err(FleetError::Gateway)?;
        let registry = gateway.registry_addr().to_string();
        let mut fleet = LocalFleet {
            gateway,
            engines: Vec::with_capacity(self.engines.len()),
        };
        for mut cfg in self.engines {
            cfg.engine.gateway_registry.clone_from(&registry);
            match EngineNode::start(&cfg).await {
                Ok(e) => fleet.engines.push(e),
                Err(source) => {
                    fleet.kill().await;
                    return Err(FleetError::Engine {
                        id: cfg.engine.id,
                        source,
                    });
                }
            }
        }
        let expected = fleet.engines.len();
        let end = Instant::now() + self.register_within;
        loop {
            let registered = fleet.gateway.registry().list(Instant::now()).len();
            if registered >= expected {
                return Ok(fleet);
            }
            if Instant::now() >= end {
                fleet.kill().await;
                return Err(FleetError::Registration {
                    registered,
                    expected,
                    within: self.register_within,
                });
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::node::config::Role;

    /// Two engines register and are listed; an engine that cannot start is named, and the
    /// gateway already started is stopped with it (its port refuses connections after).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_fleet_starts_in_order_and_a_failed_start_leaves_nothing_running() {
        let engine = |id: &str, role| {
            let mut c = Config::for_worker(id, role, "");
            c.engine.heartbeat_ms = 50;
            c.pool.n_blocks = 64;
            c
        };
        let fleet = LocalFleet::builder(GatewayConfig::local())
            .engine(engine("P", Role::Prefill))
            .engine(engine("D", Role::Decode))
            .start()
            .await
            .expect("the fleet starts");
        let listed = fleet.gateway.registry().list(Instant::now());
        assert_eq!(listed.len(), 2);
        assert_eq!(fleet.stop(Duration::from_secs(1)).await, 0);

        // Two registries asked of one engine: its configuration is refused at start.
        let mut bad = engine("B", Role::Decode);
        bad.registry.etcd_endpoints = vec!["http://127.0.0.1:9".into()];
        let mut gw = GatewayConfig::local();
        let probe = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
        let http = probe.local_addr().expect("its address");
        drop(probe);
        gw.gateway.http_listen = http.to_string();
        let err = LocalFleet::builder(gw)
            .engine(engine("P", Role::Prefill))
            .engine(bad)
            .start()
            .await
            .expect_err("the second engine cannot start");
        assert!(
            matches!(&err, FleetError::Engine { id, .. } if id == "B"),
            "{err}"
        );
        assert!(
            tokio::net::TcpStream::connect(http).await.is_err(),
            "the gateway still listens on {http}"
        );
    }
}
