//! The one path from a receiver's settlement to the broker, whether it came as a disposition
//! on the message's link or as a `$management` `update-disposition`: the wire's [`Settle`]
//! as the broker's [`Settlement`], the lock settled on the held session or the entity, and the
//! result counted.

use twice::LockToken;
use twice_amqp::servicebus::Settle;

use crate::backend::{Backend, BackendError, Settlement};
use crate::metrics::{Counter, Metrics};

/// The broker's settlement for the one a receiver asked for.
pub(crate) fn settlement_of(how: Settle) -> Settlement {
    match how {
        Settle::Complete => Settlement::Complete,
        Settle::Abandon(p) => Settlement::Abandon(p),
        Settle::Defer(p) => Settlement::Defer(p),
        Settle::DeadLetter(why, p) => Settlement::DeadLetter(why, p),
        Settle::Release => Settlement::Release,
    }
}

/// The counter a settlement adds to: defer and release have none.
pub(crate) fn counter_of(how: &Settlement) -> Option<Counter> {
    match how {
        Settlement::Complete => Some(Counter::Complete),
        Settlement::Abandon(_) => Some(Counter::Abandon),
        Settlement::DeadLetter(..) => Some(Counter::DeadLetter),
        _ => None,
    }
}

/// Settles one lock on the session that holds it, or on the entity.
pub(crate) async fn settle_one<B: Backend>(
    backend: &B,
    entity: &str,
    session: Option<&B::Session>,
    lock: LockToken,
    how: Settlement,
) -> Result<(), BackendError> {
    use crate::backend::BackendSession;
    match session {
        Some(s) => s.settle(lock, how).await,
        None => backend.settle(entity, lock, how).await,
    }
}

/// Counts a settlement's result: the settlement's counter when it succeeded, a lock loss
/// when the lock was gone.
pub(crate) fn count(
    metrics: &Metrics,
    entity: &str,
    counter: Option<Counter>,
    result: &Result<(), BackendError>,
) {
    match result {
        Ok(()) => {
            if let Some(c) = counter {
                metrics.add(entity, c, 1);
            }
        }
        Err(BackendError::LockLost | BackendError::SessionLockLost) => {
            metrics.add(entity, Counter::LockLost, 1);
        }
        Err(_) => {}
    }
}
