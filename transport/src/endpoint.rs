//! quinn endpoints for the Edge (server) and the Node (client), and the
//! peer's node id.

use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use quinn::{IdleTimeout, VarInt};
use rustls::pki_types::CertificateDer;

use crate::close::close_code_of;
pub use crate::error::TransportError;
use crate::identity::{IdentityError, node_id_from_cert};
use crate::tls::{CertDenylist, ClientTls, ServerTls, client_config, server_config_with_denylist};

/// QUIC transport settings shared by Edge and Node.
///
/// The defaults carry thousands of concurrent runs on one connection. The
/// application heartbeat (R-HB-1) detects a dead peer; the QUIC idle timeout
/// is only a backstop and must be longer than the heartbeat wait so the
/// connection ends with `heartbeat_timeout`, not with a QUIC idle timeout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QuicTuning {
    /// Close the connection after this long without any packet from the
    /// peer. Must be non-zero and longer than the app heartbeat wait.
    pub idle_timeout: Duration,
    /// Send QUIC PINGs this often when otherwise idle (keeps NAT bindings
    /// open). Must be shorter than `idle_timeout`.
    pub keep_alive: Option<Duration>,
    /// Bidirectional streams the peer may have open at once (each run,
    /// tunnel and command is one stream).
    pub max_concurrent_bidi_streams: u32,
    /// Bytes the peer may send on one stream before we read them.
    pub stream_receive_window: u64,
    /// Bytes the peer may send on all streams together before we read them.
    pub receive_window: u64,
    /// How this side asks its peer to acknowledge (the QUIC ACK frequency
    /// extension; `None`: the peer's own defaults, an ACK every second
    /// ack-eliciting packet or after its `max_ack_delay`, 25 ms).
    pub ack_frequency: Option<AckFrequency>,
    /// Whether sends may use generic segmentation offload (several
    /// datagrams in one system call) where the system supports it.
    pub segmentation_offload: bool,
    /// The congestion controller, which also sets the pacing rate.
    pub congestion: Congestion,
    /// The congestion window before any acknowledgement, bytes (`None`:
    /// the controller's default, 12,000: ten 1,200-byte datagrams).
    pub initial_window: Option<u64>,
}

/// What this side asks its peer about acknowledgements (the ACK frequency
/// extension, quinn's `AckFrequencyConfig`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AckFrequency {
    /// Ack-eliciting packets the peer may receive without acknowledging
    /// them at once (0: acknowledge every one immediately; quinn's
    /// default without the extension is 1).
    pub eliciting_threshold: u32,
    /// The longest the peer may delay an acknowledgement (`None`: its own
    /// `max_ack_delay`). quinn keeps it between 1 ms and the larger of the
    /// path's RTT and 25 ms.
    pub max_ack_delay: Option<Duration>,
}

/// The largest [`AckFrequency::eliciting_threshold`] accepted.
pub const MAX_ACK_ELICITING_THRESHOLD: u32 = 1_000;
/// The largest [`AckFrequency::max_ack_delay`] accepted: quinn never asks
/// for more than 25 ms on a path with a shorter RTT.
pub const MAX_ACK_DELAY: Duration = Duration::from_millis(25);
/// The smallest [`QuicTuning::initial_window`] accepted (two full-size
/// datagrams).
pub const MIN_INITIAL_WINDOW: u64 = 2_400;
/// The largest [`QuicTuning::initial_window`] accepted.
pub const MAX_INITIAL_WINDOW: u64 = 64 * 1024 * 1024;

/// quinn's congestion controllers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Congestion {
    /// CUBIC (RFC 9438), quinn's default.
    #[default]
    Cubic,
    /// NewReno (RFC 9002).
    NewReno,
    /// BBR (quinn marks its implementation experimental).
    Bbr,
}

impl Congestion {
    /// Its name in configuration (`cubic`, `new_reno`, `bbr`).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Cubic => "cubic",
            Self::NewReno => "new_reno",
            Self::Bbr => "bbr",
        }
    }

    /// The controller named `name`, if any.
    pub fn from_name(name: &str) -> Option<Self> {
        [Self::Cubic, Self::NewReno, Self::Bbr]
            .into_iter()
            .find(|c| c.as_str() == name)
    }
}

impl Default for QuicTuning {
    fn default() -> Self {
        Self {
            // SPEC R-HB-1's wait is 45 s; leave room above it.
            idle_timeout: Duration::from_secs(60),
            keep_alive: Some(Duration::from_secs(15)),
            max_concurrent_bidi_streams: 4096,
            stream_receive_window: 1024 * 1024,
            receive_window: 64 * 1024 * 1024,
            // quinn's defaults; measured against the alternatives in
            // docs/benchmarks.md, "quinn's transport settings".
            ack_frequency: None,
            segmentation_offload: true,
            congestion: Congestion::Cubic,
            initial_window: None,
        }
    }
}

impl QuicTuning {
    /// The defaults with a peer that stops acknowledging declared lost
    /// after `loss_detect` (R-FAIL-2): QUIC PINGs every quarter of it keep
    /// a live path busy (the peer's stack acknowledges them whatever its
    /// application is doing), and the idle timeout at `loss_detect` ends a
    /// connection that heard nothing for that long: a frozen or vanished
    /// peer, a partition.
    pub fn for_loss_detection(loss_detect: Duration) -> Self {
        Self {
            idle_timeout: loss_detect,
            keep_alive: Some(loss_detect / 4),
            ..Self::default()
        }
    }

    /// The quinn transport config for these settings.
    pub fn transport_config(&self) -> Result<quinn::TransportConfig, TransportError> {
        let invalid = |field, reason| TransportError::InvalidTuning { field, reason };
        if self.idle_timeout.is_zero() {
            // Zero disables the idle timeout in QUIC: a dead path would
            // never end the connection.
            return Err(invalid("idle_timeout", "must be non-zero"));
        }
        let idle = IdleTimeout::try_from(self.idle_timeout)
            .map_err(|_| invalid("idle_timeout", "too large"))?;
        if let Some(keep_alive) = self.keep_alive
            && (keep_alive.is_zero() || keep_alive >= self.idle_timeout)
        {
            return Err(invalid(
                "keep_alive",
                "must be non-zero and shorter than idle_timeout",
            ));
        }
        if self.max_concurrent_bidi_streams == 0 {
            return Err(invalid("max_concurrent_bidi_streams", "must be non-zero"));
        }
        if self.stream_receive_window == 0 || self.stream_receive_window > self.receive_window {
            return Err(invalid(
                "stream_receive_window",
                "must be non-zero and at most receive_window",
            ));
        }
        let stream_window = VarInt::from_u64(self.stream_receive_window)
            .map_err(|_| invalid("stream_receive_window", "too large"))?;
        let window = VarInt::from_u64(self.receive_window)
            .map_err(|_| invalid("receive_window", "too large"))?;
        let ack_frequency = match self.ack_frequency {
            None => None,
            Some(ack) => {
                if ack.eliciting_threshold > MAX_ACK_ELICITING_THRESHOLD {
                    return Err(invalid("ack_eliciting_threshold", "must be at most 1000"));
                }
                if let Some(delay) = ack.max_ack_delay
                    && (delay < Duration::from_millis(1) || delay > MAX_ACK_DELAY)
                {
                    return Err(invalid("max_ack_delay", "must be between 1 and 25 ms"));
                }
                let mut config = quinn::AckFrequencyConfig::default();
                config
                    .ack_eliciting_threshold(VarInt::from_u32(ack.eliciting_threshold))
                    .max_ack_delay(ack.max_ack_delay);
                Some(config)
            }
        };
        if let Some(w) = self.initial_window
            && !(MIN_INITIAL_WINDOW..=MAX_INITIAL_WINDOW).contains(&w)
        {
            return Err(invalid(
                "initial_window",
                "must be between 2400 bytes and 64 MiB",
            ));
        }

        let mut transport = quinn::TransportConfig::default();
        transport
            .max_idle_timeout(Some(idle))
            .keep_alive_interval(self.keep_alive)
            .max_concurrent_bidi_streams(VarInt::from_u32(self.max_concurrent_bidi_streams))
            // iop uses bidirectional streams only.
            .max_concurrent_uni_streams(VarInt::from_u32(0))
            .stream_receive_window(stream_window)
            .receive_window(window)
            .ack_frequency_config(ack_frequency)
            .enable_segmentation_offload(self.segmentation_offload)
            .congestion_controller_factory(self.congestion_factory());
        Ok(transport)
    }

    /// The congestion controller [`QuicTuning::congestion`] names, with
    /// [`QuicTuning::initial_window`] when set.
    fn congestion_factory(
        &self,
    ) -> Arc<dyn quinn::congestion::ControllerFactory + Send + Sync + 'static> {
        use quinn::congestion::{BbrConfig, CubicConfig, NewRenoConfig};
        match self.congestion {
            Congestion::Cubic => {
                let mut c = CubicConfig::default();
                if let Some(w) = self.initial_window {
                    c.initial_window(w);
                }
                Arc::new(c)
            }
            Congestion::NewReno => {
                let mut c = NewRenoConfig::default();
                if let Some(w) = self.initial_window {
                    c.initial_window(w);
                }
                Arc::new(c)
            }
            Congestion::Bbr => {
                let mut c = BbrConfig::default();
                if let Some(w) = self.initial_window {
                    c.initial_window(w);
                }
                Arc::new(c)
            }
        }
    }
}

/// The Edge's QUIC endpoint, listening on `listen`: requires a Node
/// certificate chained to `cfg.client_ca` and ALPN `iop/1`.
///
/// A Node without an acceptable certificate fails at `incoming.await` on
/// this side. Must be called inside a tokio runtime.
pub fn server_endpoint(
    cfg: &ServerTls,
    listen: SocketAddr,
    tuning: &QuicTuning,
) -> Result<quinn::Endpoint, TransportError> {
    server_endpoint_with_denylist(cfg, listen, tuning, CertDenylist::default())
}

/// Connection attempts the Edge holds before it has decided on them
/// (accept, retry or refuse); past it quinn refuses new ones at once.
pub const MAX_PENDING_INCOMING: usize = 1024;

/// [`server_endpoint`], refusing node certificates on `denylist` (which
/// may be replaced while the endpoint runs).
pub fn server_endpoint_with_denylist(
    cfg: &ServerTls,
    listen: SocketAddr,
    tuning: &QuicTuning,
    denylist: CertDenylist,
) -> Result<quinn::Endpoint, TransportError> {
    let crypto = QuicServerConfig::try_from(server_config_with_denylist(cfg, denylist)?)
        .map_err(TransportError::NoInitialCipherSuite)?;
    let mut server = quinn::ServerConfig::with_crypto(Arc::new(crypto));
    server.transport_config(Arc::new(tuning.transport_config()?));
    // R-LIM-4: a flood of Initial packets cannot queue without bound.
    server.max_incoming(MAX_PENDING_INCOMING);
    quinn::Endpoint::server(server, listen).map_err(|source| TransportError::Bind {
        addr: listen,
        source,
    })
}

/// The Node's QUIC endpoint on an ephemeral port (dual-stack `[::]:0`,
/// falling back to `0.0.0.0:0` where IPv6 is unavailable). Connections made
/// with [`connect`] present `cfg.cert_chain` and verify the Edge against
/// `cfg.server_ca`. Must be called inside a tokio runtime.
pub fn client_endpoint(
    cfg: &ClientTls,
    tuning: &QuicTuning,
) -> Result<quinn::Endpoint, TransportError> {
    let dual_stack = SocketAddr::from((Ipv6Addr::UNSPECIFIED, 0));
    match client_endpoint_on(cfg, tuning, dual_stack) {
        Err(TransportError::Bind { .. }) => {
            client_endpoint_on(cfg, tuning, SocketAddr::from((Ipv4Addr::UNSPECIFIED, 0)))
        }
        other => other,
    }
}

/// Like [`client_endpoint`], bound to `bind`.
pub fn client_endpoint_on(
    cfg: &ClientTls,
    tuning: &QuicTuning,
    bind: SocketAddr,
) -> Result<quinn::Endpoint, TransportError> {
    let crypto = QuicClientConfig::try_from(client_config(cfg)?)
        .map_err(TransportError::NoInitialCipherSuite)?;
    let mut client = quinn::ClientConfig::new(Arc::new(crypto));
    client.transport_config(Arc::new(tuning.transport_config()?));
    let mut endpoint = quinn::Endpoint::client(bind)
        .map_err(|source| TransportError::Bind { addr: bind, source })?;
    endpoint.set_default_client_config(client);
    Ok(endpoint)
}

/// Connect to the Edge at `addr`, verifying its certificate for
/// `server_name`, and wait for the handshake.
///
/// In TLS 1.3 the server checks the client certificate after the client
/// considers the handshake complete: an Edge that refuses this Node's
/// certificate shows up on the first stream read or write, not here.
pub async fn connect(
    endpoint: &quinn::Endpoint,
    addr: SocketAddr,
    server_name: &str,
) -> Result<quinn::Connection, TransportError> {
    let connecting = endpoint
        .connect(addr, server_name)
        .map_err(TransportError::Connect)?;
    connecting
        .await
        .map_err(|source| TransportError::Handshake {
            close_code: close_code_of(&source),
            source,
        })
}

/// The node id of the peer on `conn`, from its verified leaf certificate
/// (see [`node_id_from_cert`]). The Edge calls this on every accepted
/// connection and closes it with [`CloseCode::Unauthorized`] on error.
pub fn peer_node_id(conn: &quinn::Connection) -> Result<String, IdentityError> {
    let identity = conn
        .peer_identity()
        .ok_or(IdentityError::NoPeerCertificate)?;
    let certs = identity
        .downcast::<Vec<CertificateDer<'static>>>()
        .map_err(|_| IdentityError::NoPeerCertificate)?;
    let leaf = certs.first().ok_or(IdentityError::NoPeerCertificate)?;
    node_id_from_cert(leaf)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_tuning_is_valid_and_loss_detection_keeps_alive_four_times_per_bound() {
        let tuning = QuicTuning::default();
        assert!(tuning.transport_config().is_ok());
        // R-FAIL-2: lost after `loss_detect` of silence, probed 4 times in it.
        let derived = QuicTuning::for_loss_detection(Duration::from_millis(5_000));
        assert_eq!(derived.idle_timeout, Duration::from_millis(5_000));
        assert_eq!(derived.keep_alive, Some(Duration::from_millis(1_250)));
        assert!(derived.transport_config().is_ok());
        let smallest = QuicTuning::for_loss_detection(Duration::from_millis(
            crate::settings::MIN_LOSS_DETECT_MS,
        ));
        assert!(smallest.transport_config().is_ok());
    }

    #[test]
    fn out_of_range_tuning_names_the_field() {
        let cases = [
            (
                QuicTuning {
                    idle_timeout: Duration::ZERO,
                    ..QuicTuning::default()
                },
                "idle_timeout",
            ),
            (
                QuicTuning {
                    keep_alive: Some(Duration::from_secs(120)),
                    ..QuicTuning::default()
                },
                "keep_alive",
            ),
            (
                QuicTuning {
                    max_concurrent_bidi_streams: 0,
                    ..QuicTuning::default()
                },
                "max_concurrent_bidi_streams",
            ),
            (
                QuicTuning {
                    stream_receive_window: u64::MAX,
                    receive_window: u64::MAX,
                    ..QuicTuning::default()
                },
                "stream_receive_window",
            ),
            (
                QuicTuning {
                    ack_frequency: Some(AckFrequency {
                        eliciting_threshold: MAX_ACK_ELICITING_THRESHOLD + 1,
                        max_ack_delay: None,
                    }),
                    ..QuicTuning::default()
                },
                "ack_eliciting_threshold",
            ),
            (
                QuicTuning {
                    ack_frequency: Some(AckFrequency {
                        eliciting_threshold: 0,
                        max_ack_delay: Some(Duration::from_micros(500)),
                    }),
                    ..QuicTuning::default()
                },
                "max_ack_delay",
            ),
            (
                QuicTuning {
                    initial_window: Some(MIN_INITIAL_WINDOW - 1),
                    ..QuicTuning::default()
                },
                "initial_window",
            ),
        ];
        for (tuning, field) in cases {
            match tuning.transport_config() {
                Err(TransportError::InvalidTuning { field: got, .. }) => assert_eq!(got, field),
                other => panic!("{field}: expected InvalidTuning, got {other:?}"),
            }
        }
    }
}
