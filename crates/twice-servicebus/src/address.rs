//! Entity addresses as the SDKs send them, and what they point at.
//!
//! The three SDKs spell the same entity three ways: `amqps://localhost:5673/q1` (Python, even
//! without TLS), `amqp://localhost:5673/q1` (Rust) and `q1` (JavaScript). Entity names are
//! case-insensitive in Service Bus, so a path is normalised to lowercase without scheme,
//! authority or surrounding slashes.

/// The normalised entity path of an address: scheme and authority stripped, lowercase, no
/// leading or trailing `/`.
pub fn normalize(address: &str) -> String {
    let path = match address.split_once("://") {
        Some((_, rest)) => rest.split_once('/').map_or("", |(_, p)| p),
        None => address,
    };
    path.trim_matches('/').to_ascii_lowercase()
}

/// The node a link addresses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Node {
    /// The claims-based-security node `$cbs`.
    Cbs,
    /// The management node of an entity (`<entity>/$management`).
    Management(String),
    /// An entity: queue, topic, subscription or dead-letter queue.
    Entity(String),
}

impl Node {
    /// Classifies a normalised path.
    pub fn of(path: &str) -> Self {
        if path == "$cbs" {
            Node::Cbs
        } else if let Some(entity) = path.strip_suffix("/$management") {
            Node::Management(entity.to_owned())
        } else if path == "$management" {
            Node::Management(String::new())
        } else {
            Node::Entity(path.to_owned())
        }
    }
}

/// The entity a transfer-dead-letter or dead-letter path belongs to, and whether it is one.
pub fn dead_letter_parent(path: &str) -> Option<&str> {
    path.strip_suffix("/$deadletterqueue").map(|p| p.strip_suffix("/$transfer").unwrap_or(p))
}

/// Whether a normalised path is a transfer dead-letter queue (`<entity>/$transfer/$deadletterqueue`).
/// twice forwards only within its one namespace, where a transfer never fails, so this queue
/// exists for every queue and subscription and is always empty.
pub fn is_transfer_dead_letter(path: &str) -> bool {
    path.ends_with("/$transfer/$deadletterqueue")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normalizes_the_three_sdk_shapes() {
        assert_eq!(normalize("amqps://localhost:5673/q1"), "q1");
        assert_eq!(normalize("amqp://localhost:5673/rq"), "rq");
        assert_eq!(normalize("jq"), "jq");
        assert_eq!(
            normalize("amqps://localhost:5673/topic1/Subscriptions/sub1"),
            "topic1/subscriptions/sub1"
        );
        assert_eq!(normalize("amqps://localhost:5673/q1/$DeadLetterQueue"), "q1/$deadletterqueue");
        assert_eq!(normalize("amqps://localhost:5673"), "");
        assert_eq!(normalize("/q1/"), "q1");
    }

    #[test]
    fn classifies_nodes() {
        assert_eq!(Node::of("$cbs"), Node::Cbs);
        assert_eq!(Node::of("q1/$management"), Node::Management("q1".into()));
        assert_eq!(
            Node::of("rq/$deadletterqueue/$management"),
            Node::Management("rq/$deadletterqueue".into())
        );
        assert_eq!(Node::of("q1"), Node::Entity("q1".into()));
        assert_eq!(dead_letter_parent("q1/$deadletterqueue"), Some("q1"));
        assert_eq!(dead_letter_parent("q1/$transfer/$deadletterqueue"), Some("q1"));
        assert_eq!(dead_letter_parent("q1"), None);
        assert!(is_transfer_dead_letter("q1/$transfer/$deadletterqueue"));
        assert!(is_transfer_dead_letter("t/subscriptions/s/$transfer/$deadletterqueue"));
        assert!(!is_transfer_dead_letter("q1/$deadletterqueue"));
    }
}
