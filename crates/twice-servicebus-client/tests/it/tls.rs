//! amqps: `twice serve` with a certificate made in the test, and the client trusting its CA.

use std::time::Duration;

use twice::Message;
use twice_servicebus::ServerOptions;
use twice_servicebus_client::{
    ClientOptions, Error, ReceiverOptions, ServiceBusClient, TlsOptions,
};
use twice_testkit::tls::TestCertificates;

use crate::harness::Serve;

async fn tls_server() -> (Serve, String) {
    let certs = TestCertificates::localhost();
    let options =
        ServerOptions::new().tls_pem(certs.cert_pem.as_bytes(), certs.key_pem.as_bytes()).unwrap();
    (Serve::start_with(options).await, certs.ca_pem)
}

#[tokio::test]
async fn the_client_sends_and_receives_over_tls() {
    let (s, ca) = tls_server().await;
    // Without the emulator flag, the connection string means TLS.
    assert!(!s.connection_string.contains("UseDevelopmentEmulator"));
    let options = ClientOptions::from_connection_string(&s.connection_string)
        .unwrap()
        .tls(Some(TlsOptions::with_ca_pem(ca.as_bytes()).unwrap()));
    let client = ServiceBusClient::new(options);
    client.sender("q").send_message(Message::new("sealed")).await.unwrap();
    let receiver = client.receiver("q", ReceiverOptions::new());
    let d = receiver.receive_messages(1, Duration::from_secs(5)).await.unwrap().pop().unwrap();
    assert_eq!(&d.message().body()[..], b"sealed");
    receiver.complete_message(&d).await.unwrap();
}

#[tokio::test]
async fn an_untrusted_certificate_and_plain_amqp_are_refused() {
    let (s, _ca) = tls_server().await;
    // The webpki roots (what Azure needs) do not include the test CA.
    let options = ClientOptions::from_connection_string(&s.connection_string)
        .unwrap()
        .operation_timeout(Duration::from_secs(10));
    let err = ServiceBusClient::new(options).connect().await.unwrap_err();
    assert!(matches!(err, Error::Tls(_)), "{err}");
    // A plain AMQP client gets an error, not a hang.
    let plain = ClientOptions::from_connection_string(&s.connection_string)
        .unwrap()
        .tls(None)
        .operation_timeout(Duration::from_secs(10));
    let err = ServiceBusClient::new(plain).connect().await.unwrap_err();
    assert!(matches!(err, Error::Handshake(_)), "{err}");
}

#[test]
fn a_ca_file_without_certificates_is_an_error() {
    assert!(matches!(TlsOptions::with_ca_pem(b"not a certificate"), Err(Error::Tls(_))));
}

/// A connection string without the emulator flag asks for TLS; a server that speaks plain AMQP
/// answers the client hello with its protocol header: `Error::NotTls`, not a certificate error.
#[tokio::test]
async fn a_plain_server_asked_for_tls_is_not_tls_rather_than_untrusted() {
    let s = Serve::start().await;
    let tls = s.connection_string.replace("UseDevelopmentEmulator=true;", "");
    assert_ne!(tls, s.connection_string);
    let options = ClientOptions::from_connection_string(&tls)
        .unwrap()
        .operation_timeout(Duration::from_secs(10));
    let err = ServiceBusClient::new(options).connect().await.unwrap_err();
    assert!(matches!(err, Error::NotTls { .. }), "{err}");
}
