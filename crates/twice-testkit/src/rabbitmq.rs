//! RabbitMQ fixtures: a queue name per test, deleted (with its dead-letter queue) on `Drop`.

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, QueueDeleteOptions};
use lapin::{BasicProperties, Connection, ConnectionProperties};

/// The server every RabbitMQ test connects to.
pub const RABBITMQ_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

/// A unique queue name; the queue and `<name>.dead-letter` are deleted on `Drop`.
#[derive(Debug)]
pub struct TestQueue {
    name: String,
}

impl TestQueue {
    /// A new unique name starting with `prefix`.
    pub fn new(prefix: &str) -> Self {
        Self { name: crate::db::unique_name(prefix) }
    }

    /// The queue name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Publishes `body` with no properties at all (no message id), as a client other than
    /// twice might, and waits for the confirm.
    ///
    /// # Errors
    ///
    /// When RabbitMQ is unreachable or refuses the message.
    pub async fn publish_raw(&self, body: &[u8]) -> Result<(), lapin::Error> {
        let conn = Connection::connect(RABBITMQ_URL, ConnectionProperties::default()).await?;
        let ch = conn.create_channel().await?;
        ch.confirm_select(ConfirmSelectOptions::default()).await?;
        ch.basic_publish(
            "".into(),
            self.name.as_str().into(),
            BasicPublishOptions::default(),
            body,
            BasicProperties::default(),
        )
        .await?
        .await?;
        conn.close(200, "done".into()).await
    }
}

impl Drop for TestQueue {
    fn drop(&mut self) {
        let queues = [self.name.clone(), format!("{}.dead-letter", self.name)];
        crate::run_cleanup("RabbitMQ queue", move || async move {
            let conn = Connection::connect(RABBITMQ_URL, ConnectionProperties::default()).await?;
            let ch = conn.create_channel().await?;
            for q in queues {
                ch.queue_delete(q.as_str().into(), QueueDeleteOptions::default()).await?;
            }
            conn.close(200, "done".into()).await?;
            Ok::<(), lapin::Error>(())
        });
    }
}
