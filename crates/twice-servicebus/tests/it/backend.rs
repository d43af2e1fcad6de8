//! The front end's boundary to the broker: what a link's calls may reach.

use std::time::Duration;

use twice_broker::config::QueueProperties;
use twice_broker::{Broker, BrokerOptions};
use twice_servicebus::{Backend, BackendError, ReceiveMode, Settlement};

/// A lock token is a capability of the link that received the message: presented through
/// another entity's link (or `$management` node) it settles, renews and completes nothing.
#[tokio::test]
async fn a_lock_token_settles_nothing_through_another_entitys_link() {
    let broker = Broker::open(BrokerOptions::in_memory()).await.unwrap();
    for q in ["a", "b"] {
        broker.create_queue(q, QueueProperties::default()).await.unwrap();
        broker.send(q, twice::Message::new(q)).await.unwrap();
    }
    let got = Backend::receive(&broker, "a", ReceiveMode::PeekLock, 1, Duration::from_secs(1))
        .await
        .unwrap();
    let lock = got[0].lock_token.expect("peek-lock");
    let lost = |r: &Result<_, BackendError>| matches!(r, Err(BackendError::LockLost));

    let complete = Backend::settle(&broker, "b", lock, Settlement::Complete).await;
    assert!(lost(&complete), "{complete:?}");
    let many = Backend::complete_many(&broker, "b", vec![lock, lock]).await;
    assert!(many.iter().all(lost), "{many:?}");
    let renew = Backend::renew_lock(&broker, "b", lock).await;
    assert!(matches!(renew, Err(BackendError::LockLost)), "{renew:?}");
    let dlq = Backend::settle(&broker, "a/$deadletterqueue", lock, Settlement::Complete).await;
    assert!(lost(&dlq), "{dlq:?}");
    let a = broker.counts("a").await.unwrap();
    assert_eq!((a.active, a.locked), (1, 1), "the message is still locked in a");

    // Through its own entity the same token works.
    Backend::settle(&broker, "a", lock, Settlement::Complete).await.unwrap();
    assert_eq!(broker.counts("a").await.unwrap().active, 0);
    assert_eq!(broker.counts("b").await.unwrap().active, 1);
    broker.shutdown().await;
}
