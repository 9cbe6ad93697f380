//! An https inbox for TLS tests (axum over tokio-rustls): answers 204 and
//! records each body with its `X-Event-Signature`; optionally asks every
//! client for a certificate signed by a given CA (mutual TLS). It can be
//! stopped and started again on the same port with other certificates, as
//! a receiver rotating its own does.

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

type Received = Arc<Mutex<Vec<(String, Option<String>)>>>;

/// A running https inbox.
pub struct TlsSink {
    /// `https://localhost:PORT/inbox`.
    pub url: String,
    port: u16,
    received: Received,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

impl TlsSink {
    /// Serves with `cert`/`key` on a free port; with `client_ca`, only to
    /// clients presenting a certificate that CA signed.
    pub async fn start(
        cert: &Path,
        key: &Path,
        client_ca: Option<&Path>,
    ) -> anyhow::Result<TlsSink> {
        let mut sink = TlsSink {
            url: String::new(),
            port: 0,
            received: Received::default(),
            stop: None,
        };
        sink.restart(cert, key, client_ca).await?;
        Ok(sink)
    }

    /// Stops serving (open connections are closed) and serves again on
    /// the same port with these certificates; what it received is kept.
    pub async fn restart(
        &mut self,
        cert: &Path,
        key: &Path,
        client_ca: Option<&Path>,
    ) -> anyhow::Result<()> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let app = axum::Router::new()
            .route("/inbox", axum::routing::post(record))
            .with_state(self.received.clone());
        let (port, stop) = serve_tls(cert, key, client_ca, self.port, app).await?;
        self.port = port;
        self.url = format!("https://localhost:{}/inbox", self.port);
        self.stop = Some(stop);
        Ok(())
    }

    /// Every body received, with its `X-Event-Signature`, in order.
    pub fn bodies(&self) -> Vec<(String, Option<String>)> {
        self.received.lock().expect("sink lock").clone()
    }

    /// Whether some body received contains `needle`.
    pub fn got(&self, needle: &str) -> bool {
        self.bodies().iter().any(|(b, _)| b.contains(needle))
    }
}

/// Serves `app` over TLS with `cert`/`key` on 127.0.0.1:`port` (0: a free
/// one); with `client_ca`, only to clients presenting a certificate that
/// CA signed. Returns the port and the sender that stops it.
pub async fn serve_tls(
    cert: &Path,
    key: &Path,
    client_ca: Option<&Path>,
    port: u16,
    app: axum::Router,
) -> anyhow::Result<(u16, tokio::sync::oneshot::Sender<()>)> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let certs = CertificateDer::pem_file_iter(cert)?.collect::<Result<Vec<_>, _>>()?;
    let key = PrivateKeyDer::from_pem_file(key)?;
    let builder = rustls::ServerConfig::builder_with_provider(Arc::clone(&provider))
        .with_safe_default_protocol_versions()?;
    let builder = match client_ca {
        None => builder.with_no_client_auth(),
        Some(ca) => {
            let mut roots = rustls::RootCertStore::empty();
            for c in CertificateDer::pem_file_iter(ca)? {
                roots.add(c?)?;
            }
            let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                Arc::new(roots),
                provider,
            )
            .build()?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let config = builder.with_single_cert(certs, key)?;
    let tcp = tokio::net::TcpListener::bind(("127.0.0.1", port))
        .await
        .with_context(|| format!("binding 127.0.0.1:{port}"))?;
    let port = tcp.local_addr()?.port();
    let listener = TlsListener {
        tcp,
        acceptor: tokio_rustls::TlsAcceptor::from(Arc::new(config)),
    };
    Ok((port, crate::sink::serve(listener, app)))
}

async fn record(
    axum::extract::State(received): axum::extract::State<Received>,
    headers: axum::http::HeaderMap,
    body: String,
) -> axum::http::StatusCode {
    let signature = headers
        .get("x-event-signature")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    received.lock().expect("sink lock").push((body, signature));
    axum::http::StatusCode::NO_CONTENT
}

/// TCP accept plus the TLS handshake; a failed handshake (an untrusting or
/// untrusted client) is dropped and the next connection accepted.
struct TlsListener {
    tcp: tokio::net::TcpListener,
    acceptor: tokio_rustls::TlsAcceptor,
}

impl axum::serve::Listener for TlsListener {
    type Io = tokio_rustls::server::TlsStream<tokio::net::TcpStream>;
    type Addr = std::net::SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            let Ok((tcp, addr)) = self.tcp.accept().await else {
                continue;
            };
            if let Ok(Ok(tls)) =
                tokio::time::timeout(Duration::from_secs(5), self.acceptor.accept(tcp)).await
            {
                return (tls, addr);
            }
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        self.tcp.local_addr()
    }
}
