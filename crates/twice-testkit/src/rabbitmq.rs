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

    /// This queue name, as it is (deleted on `Drop` all the same).
    pub fn named(name: impl Into<String>) -> Self {
        Self { name: name.into() }
    }

    /// The queue name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Declares the queue as its owner would by hand: durable, with these string and integer
    /// arguments, and nothing else.
    ///
    /// # Errors
    ///
    /// When RabbitMQ is unreachable or refuses the declaration.
    pub async fn declare_by_hand(
        &self,
        text: &[(&str, &str)],
        integers: &[(&str, i64)],
    ) -> Result<(), lapin::Error> {
        use lapin::types::{AMQPValue, FieldTable};
        let mut args = FieldTable::default();
        for (k, v) in text {
            args.insert((*k).into(), AMQPValue::LongString((*v).into()));
        }
        for (k, v) in integers {
            args.insert((*k).into(), AMQPValue::LongLongInt(*v));
        }
        let conn = Connection::connect(RABBITMQ_URL, ConnectionProperties::default()).await?;
        let ch = conn.create_channel().await?;
        let durable = lapin::options::QueueDeclareOptions { durable: true, ..Default::default() };
        ch.queue_declare(self.name.as_str().into(), durable, args).await?;
        conn.close(200, "done".into()).await
    }

    /// Publishes `body` with no properties at all (no message id), as a client other than
    /// twice might, and waits for the confirm.
    ///
    /// # Errors
    ///
    /// When RabbitMQ is unreachable or refuses the message.
    pub async fn publish_raw(&self, body: &[u8]) -> Result<(), lapin::Error> {
        publish_raw_to(&self.name, body).await
    }
}

/// Publishes `body` to `queue` with no properties at all (no message id), and waits for the
/// confirm.
///
/// # Errors
///
/// When RabbitMQ is unreachable or refuses the message.
pub async fn publish_raw_to(queue: &str, body: &[u8]) -> Result<(), lapin::Error> {
    let conn = Connection::connect(RABBITMQ_URL, ConnectionProperties::default()).await?;
    let ch = conn.create_channel().await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    ch.basic_publish(
        "".into(),
        queue.into(),
        BasicPublishOptions::default(),
        body,
        BasicProperties::default(),
    )
    .await?
    .await?;
    conn.close(200, "done".into()).await
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

/// A virtual host of its own on the machine's RabbitMQ, with `guest` allowed everything in it,
/// deleted (with its queues) on `Drop`. Made with `rabbitmqctl`, which the tests run as a user
/// allowed to administer the local node.
#[derive(Debug)]
pub struct TestVhost {
    name: String,
}

impl TestVhost {
    /// A new vhost named after `prefix`.
    ///
    /// # Errors
    ///
    /// When `rabbitmqctl` is missing or fails (the server is down, or this user may not
    /// administer it).
    pub fn new(prefix: &str) -> std::io::Result<Self> {
        let name = crate::db::unique_name(prefix);
        rabbitmqctl(&["add_vhost", &name])?;
        let vhost = Self { name };
        rabbitmqctl(&["set_permissions", "-p", &vhost.name, "guest", ".*", ".*", ".*"])?;
        Ok(vhost)
    }

    /// The vhost's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The URL of the machine's RabbitMQ in this vhost.
    pub fn url(&self) -> String {
        format!("amqp://guest:guest@127.0.0.1:5672/{}", self.name)
    }
}

fn rabbitmqctl(args: &[&str]) -> std::io::Result<()> {
    let out = std::process::Command::new("rabbitmqctl").args(args).output()?;
    if out.status.success() {
        Ok(())
    } else {
        Err(std::io::Error::other(format!(
            "rabbitmqctl {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        )))
    }
}

impl Drop for TestVhost {
    fn drop(&mut self) {
        if let Err(e) = rabbitmqctl(&["delete_vhost", &self.name]) {
            eprintln!("RabbitMQ vhost clean-up failed: {e}");
        }
    }
}
