//! NATS JetStream fixtures: a stream name per test, deleted (with its dead-letter stream) on
//! `Drop`.

/// The server every NATS test connects to.
pub const NATS_URL: &str = "nats://127.0.0.1:4222";

/// A unique stream name (upper case, as JetStream names usually are); the stream and
/// `<NAME>_DEAD_LETTER` are deleted on `Drop`.
#[derive(Debug)]
pub struct TestStream {
    name: String,
}

impl TestStream {
    /// A new unique name starting with `prefix`.
    pub fn new(prefix: &str) -> Self {
        Self { name: crate::db::unique_name(prefix).to_uppercase() }
    }

    /// The stream name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The subject the transport's default options give the stream.
    pub fn subject(&self) -> String {
        self.name.to_lowercase()
    }

    /// Publishes `body` to the stream's subject with no headers at all (no `Nats-Msg-Id`), as
    /// a client other than twice might, and waits for the stream's acknowledgement.
    ///
    /// # Errors
    ///
    /// When NATS is unreachable or the stream does not take it.
    pub async fn publish_raw(&self, body: &'static [u8]) -> Result<(), async_nats::Error> {
        publish_raw_to(&self.subject(), body).await
    }
}

/// Publishes `body` to `subject` with no headers at all, and waits for a stream's
/// acknowledgement.
///
/// # Errors
///
/// When NATS is unreachable or no stream takes it.
pub async fn publish_raw_to(subject: &str, body: &'static [u8]) -> Result<(), async_nats::Error> {
    let client = async_nats::connect(NATS_URL).await?;
    let js = async_nats::jetstream::new(client);
    js.publish(subject.to_owned(), body.into()).await?.await?;
    Ok(())
}

impl Drop for TestStream {
    fn drop(&mut self) {
        let streams = [self.name.clone(), format!("{}_DEAD_LETTER", self.name)];
        crate::run_cleanup("NATS stream", move || async move {
            let client = async_nats::connect(NATS_URL).await?;
            let js = async_nats::jetstream::new(client);
            for s in streams {
                // A stream the test never created is fine.
                let _ = js.delete_stream(&s).await;
            }
            Ok::<(), async_nats::Error>(())
        });
    }
}
