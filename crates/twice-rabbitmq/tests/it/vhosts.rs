//! Queues of the same name in two virtual hosts are two entities: their claims are apart.

use std::time::Duration;

use twice::{Message, Transport as _};
use twice_rabbitmq::{RabbitMqOptions, RabbitMqTransport};
use twice_testkit::rabbitmq::TestVhost;

use crate::handled::{Inbox, run_until};

#[tokio::test]
async fn same_named_queues_in_two_vhosts_do_not_share_claims() {
    let Some(a) = twice_testkit::require_service("rabbitmqctl", TestVhost::new("twice-a")) else {
        return;
    };
    let Some(b) = twice_testkit::require_service("rabbitmqctl", TestVhost::new("twice-b")) else {
        return;
    };
    let inbox = Inbox::new().await;
    let bound = Duration::from_secs(20);
    let mut handled = Vec::new();
    for (vhost, body) in [(&a, "in a"), (&b, "in b")] {
        let t =
            RabbitMqTransport::connect(RabbitMqOptions::new(vhost.url(), "orders")).await.unwrap();
        // The same message id in both: two producers that number their messages alike.
        t.send(Message::new(body).with_message_id("order-1")).await.unwrap();
        let consumer = t.entity().path.clone();
        let seen = run_until(t, &inbox, &consumer, bound, |c| c.completed >= 1).await;
        handled.extend(seen.handled);
    }
    assert_eq!(handled, ["in a", "in b"], "the second vhost's message was taken for the first's");
}
