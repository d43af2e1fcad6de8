//! Entities and their properties, and the official Service Bus emulator's `Config.json`.
//!
//! An entity is a queue, a topic, or a subscription of a topic, each declared by an
//! [`EntityDefinition`]. Properties carry the Service Bus names, defaults and ranges:
//!
//! | property | default | in a `Config.json` | range |
//! |---|---|---|---|
//! | `LockDuration` | `PT1M` | `PT1M` | 5 s to 5 min |
//! | `MaxDeliveryCount` | 10 | 3 | at least 1 |
//! | `DefaultMessageTimeToLive` | none (messages live until settled) | `PT1H` | at least 1 s |
//! | `DeadLetteringOnMessageExpiration` | `false` | `false` | |
//! | `RequiresDuplicateDetection` | `false` | `false` | fixed at creation |
//! | `DuplicateDetectionHistoryTimeWindow` | `PT10M` | `PT20S` | 5 s to 7 days |
//! | `RequiresSession` | `false` | fixed at creation |
//! | `ForwardTo`, `ForwardDeadLetteredMessagesTo` | none | a queue or topic name |
//! | `MaxSizeInMegabytes` (queues and topics) | 1024 | 1 to 81920 |
//!
//! [`Config::from_json`] reads the emulator's file format (`UserConfig` → `Namespaces[]` →
//! `Queues[]` / `Topics[]` → `Subscriptions[]` → `Rules[]`, each with `Name` and `Properties`),
//! comments included, so a file written for the emulator works unchanged: a property the file
//! leaves out takes the emulator's default (the third column above; [`emulator_defaults`]),
//! while entities created through the API take Service Bus's. Its namespace name is not
//! checked. Every error names the JSON path of the value it rejects.
//!
//! ```
//! use twice_broker::config::Config;
//!
//! let config = Config::from_json(r#"{
//!   "UserConfig": {
//!     "Namespaces": [{
//!       "Name": "sbemulatorns",
//!       "Queues": [{ "Name": "orders", "Properties": { "LockDuration": "PT30S" } }],
//!       "Topics": []
//!     }],
//!     "Logging": { "Type": "Console" }
//!   }
//! }"#)?;
//! let entities = config.entities()?;
//! assert_eq!(entities[0].path(), "orders");
//! # Ok::<(), twice_broker::Error>(())
//! ```
//!
//! The module has three parts: the entity model the engine imports ([`QueueProperties`],
//! [`EntityDefinition`], rules and filters, and their validation), ISO-8601 durations
//! ([`parse_duration`], [`format_duration`]), and the `Config.json` reader ([`Config`]), the
//! only part that reads a file.

mod json;
mod model;
#[cfg(test)]
mod tests;

pub use self::json::{
    Config, EMULATOR_DUPLICATE_DETECTION_WINDOW, EMULATOR_MAX_DELIVERY_COUNT,
    EMULATOR_TIME_TO_LIVE, NamespaceConfig, TopicConfig, emulator_defaults,
};
pub use self::model::*;
pub use twice::iso_duration::{format_duration, parse_duration};
