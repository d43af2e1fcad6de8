//! Idempotency keys for work that cannot join the inbox transaction.
//!
//! A payment or e-mail API cannot take part in the database transaction that claims a message,
//! so a process that dies after calling it and before committing will call it again when the
//! message is redelivered. Such APIs accept an idempotency key; [`IdempotencyKey::derive`]
//! builds one from the consumer, the message id and the step, so every redelivery of the same
//! message passes the same key and the second call returns the first call's result.

use std::fmt;

use uuid::Uuid;

use crate::ids::MessageId;

/// The namespace of twice's name-based (version 5) UUIDs. Changing it would change every key,
/// so it is fixed forever.
const NAMESPACE: Uuid = Uuid::from_u128(0x6a1c_9e2e_7f3b_4d0a_9c55_2b8e_1d4f_7a60);

/// A stable key derived from (consumer, message id, step): the same on every delivery of a
/// message, different for another consumer, message or step.
///
/// It is a name-based UUID (36 characters), short enough for every API that takes a key.
///
/// ```
/// use twice::{IdempotencyKey, MessageId};
///
/// let id = MessageId::new("order-42-placed");
/// let a = IdempotencyKey::derive("shipping", &id, "charge");
/// let b = IdempotencyKey::derive("shipping", &id, "charge");
/// assert_eq!(a, b);
/// assert_ne!(a, IdempotencyKey::derive("shipping", &id, "email"));
/// ```
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct IdempotencyKey(String);

impl IdempotencyKey {
    /// The key for `step` of the work on message `message_id` by `consumer`.
    pub fn derive(consumer: &str, message_id: &MessageId, step: &str) -> Self {
        Self::from_parts(&[consumer, message_id.as_str(), step])
    }

    /// The key for `step` of the work on the business entity `business_key` (say, `order-42`)
    /// by `consumer`, whatever message carries it.
    ///
    /// Use it when the same event can arrive under two message ids (a sender that published it
    /// twice): a first copy that called the payment API and then rolled back leaves the charge
    /// made, and only a key taken from the order lets the second copy's call be recognised. A
    /// business key never yields the key of a message id, even when the strings are equal.
    ///
    /// ```
    /// use twice::{IdempotencyKey, MessageId};
    ///
    /// let a = IdempotencyKey::for_business_key("shipping", "order-42", "charge");
    /// assert_eq!(a, IdempotencyKey::for_business_key("shipping", "order-42", "charge"));
    /// assert_ne!(a, IdempotencyKey::derive("shipping", &MessageId::new("order-42"), "charge"));
    /// ```
    pub fn for_business_key(consumer: &str, business_key: &str, step: &str) -> Self {
        // The marker part keeps this family of keys apart from the message-id family, which
        // has three parts.
        Self::from_parts(&[consumer, business_key, step, "business-key"])
    }

    fn from_parts(parts: &[&str]) -> Self {
        Self(name_uuid(parts))
    }

    /// The key as a string.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// A name-based (version 5) UUID of `parts`, in twice's namespace: each part is prefixed with
/// its length, so that `("ab", "c")` and `("a", "bc")` differ. Idempotency keys and the
/// outbox's derived message ids are made with it; families of names are kept apart by a marker
/// part of their own.
pub(crate) fn name_uuid(parts: &[&str]) -> String {
    let mut name = Vec::with_capacity(parts.iter().map(|p| p.len() + 8).sum());
    for part in parts {
        name.extend_from_slice(&u64::try_from(part.len()).unwrap_or(u64::MAX).to_be_bytes());
        name.extend_from_slice(part.as_bytes());
    }
    Uuid::new_v5(&NAMESPACE, &name).hyphenated().to_string()
}

impl fmt::Debug for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.0, f)
    }
}

impl fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_stable_and_scoped() {
        let id = MessageId::new("m-1");
        let key = IdempotencyKey::derive("billing", &id, "charge");
        // The value is part of the contract: it must not change between releases.
        assert_eq!(key, IdempotencyKey::derive("billing", &id, "charge"));
        assert_eq!(key.as_str().len(), 36);
        assert_ne!(key, IdempotencyKey::derive("shipping", &id, "charge"));
        assert_ne!(key, IdempotencyKey::derive("billing", &MessageId::new("m-2"), "charge"));
        assert_ne!(
            IdempotencyKey::derive("ab", &MessageId::new("c"), "x"),
            IdempotencyKey::derive("a", &MessageId::new("bc"), "x")
        );
    }
}
