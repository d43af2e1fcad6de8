//! Certificates for TLS tests: a CA made for the test, and a certificate for `localhost` that
//! it signed.

use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair};

/// A test CA and a `localhost` certificate it signed, all PEM.
#[derive(Clone, Debug)]
pub struct TestCertificates {
    /// The CA's certificate: what a client is told to trust.
    pub ca_pem: String,
    /// The server's certificate, for `localhost`.
    pub cert_pem: String,
    /// The server's private key.
    pub key_pem: String,
}

impl TestCertificates {
    /// Makes a fresh CA and a certificate for `localhost` signed by it.
    ///
    /// # Panics
    ///
    /// When key generation or signing fails (a broken crypto backend: the test cannot run).
    #[must_use]
    pub fn localhost() -> Self {
        let mut ca = CertificateParams::new(Vec::<String>::new()).expect("CA parameters");
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.distinguished_name.push(DnType::CommonName, "twice test CA");
        let ca_key = KeyPair::generate().expect("CA key");
        let ca = ca.self_signed(&ca_key).expect("CA certificate");
        let key = KeyPair::generate().expect("server key");
        let cert = CertificateParams::new(vec!["localhost".to_owned()])
            .expect("server parameters")
            .signed_by(&key, &ca, &ca_key)
            .expect("server certificate");
        Self { ca_pem: ca.pem(), cert_pem: cert.pem(), key_pem: key.serialize_pem() }
    }
}
