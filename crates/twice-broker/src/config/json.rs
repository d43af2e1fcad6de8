//! The official Service Bus emulator's `Config.json`: the only part of the broker that reads a
//! file.

use std::path::Path;
use std::time::Duration;

use serde::de::{self, Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Value as Json};
use twice::{Properties, Value};

use super::model::{
    CorrelationFilter, EntityDefinition, Filter, QueueProperties, Rule, SubscriptionProperties,
    TopicProperties, validate_entity_name, validate_subscription_name,
};
use crate::error::Error;
use crate::sql::{SqlAction, SqlFilter};
use twice::iso_duration::parse_duration;

/// A parsed emulator `Config.json`.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct Config {
    /// The namespaces (the emulator allows exactly one; any number is accepted here, and their
    /// entities share one broker).
    pub namespaces: Vec<NamespaceConfig>,
    /// `Logging.Type`, kept but not used by the broker.
    pub logging: Option<String>,
}

/// One namespace of a [`Config`].
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct NamespaceConfig {
    /// Its name (not checked).
    pub name: String,
    /// Its queues.
    pub queues: Vec<(String, QueueProperties)>,
    /// Its topics.
    pub topics: Vec<TopicConfig>,
}

/// One topic of a [`NamespaceConfig`].
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct TopicConfig {
    /// The topic name.
    pub name: String,
    /// Its properties.
    pub properties: TopicProperties,
    /// Its subscriptions: name, properties and rules (empty: the `$Default` rule).
    pub subscriptions: Vec<(String, SubscriptionProperties, Vec<Rule>)>,
}

impl Config {
    /// Reads and parses a `Config.json` file.
    pub fn from_path(path: &Path) -> Result<Self, Error> {
        let text = std::fs::read_to_string(path)
            .map_err(|source| Error::ConfigIo { path: path.to_owned(), source })?;
        Self::from_json(&text)
    }

    /// Parses the text of a `Config.json` file. `//` and `/* */` comments are allowed, as the
    /// emulator's own sample has them.
    pub fn from_json(text: &str) -> Result<Self, Error> {
        let stripped = strip_comments(text);
        let Strict(root) = serde_json::from_str(&stripped)
            .map_err(|e| Error::Config { path: "$".to_owned(), message: e.to_string() })?;
        parse_root(&root)
    }

    /// The entity definitions to create, topics before their subscriptions.
    ///
    /// Fails on what the broker cannot apply: a SQL filter (not supported yet), an entity
    /// declared twice, or a `ForwardTo` naming an entity the file does not declare. Each
    /// error names the JSON path.
    pub fn entities(&self) -> Result<Vec<EntityDefinition>, Error> {
        let mut out = Vec::new();
        let mut names: Vec<String> = Vec::new();
        for (n, ns) in self.namespaces.iter().enumerate() {
            let ns_path = format!("UserConfig.Namespaces[{n}]");
            for (q, (name, props)) in ns.queues.iter().enumerate() {
                let path = format!("{ns_path}.Queues[{q}].Name");
                claim_name(&mut names, name, &path)?;
                out.push(EntityDefinition::queue(name.clone(), props.clone()));
            }
            for (t, topic) in ns.topics.iter().enumerate() {
                let path = format!("{ns_path}.Topics[{t}]");
                claim_name(&mut names, &topic.name, &format!("{path}.Name"))?;
                out.push(EntityDefinition::topic(topic.name.clone(), topic.properties.clone()));
                let mut sub_names: Vec<String> = Vec::new();
                for (s, (name, props, rules)) in topic.subscriptions.iter().enumerate() {
                    let sub_path = format!("{path}.Subscriptions[{s}]");
                    claim_name(&mut sub_names, name, &format!("{sub_path}.Name"))?;
                    out.push(EntityDefinition::subscription(
                        topic.name.clone(),
                        name.clone(),
                        props.clone(),
                        rules.clone(),
                    ));
                }
            }
        }
        // Forwarding targets must be declared in the same file.
        for (n, ns) in self.namespaces.iter().enumerate() {
            let ns_path = format!("UserConfig.Namespaces[{n}]");
            for (q, (_, props)) in ns.queues.iter().enumerate() {
                let path = format!("{ns_path}.Queues[{q}].Properties");
                check_target(&names, props.forward_to.as_deref(), &path, "ForwardTo")?;
                check_target(
                    &names,
                    props.forward_dead_lettered_messages_to.as_deref(),
                    &path,
                    "ForwardDeadLetteredMessagesTo",
                )?;
            }
            for (t, topic) in ns.topics.iter().enumerate() {
                for (s, (_, props, _)) in topic.subscriptions.iter().enumerate() {
                    let path = format!("{ns_path}.Topics[{t}].Subscriptions[{s}].Properties");
                    check_target(&names, props.forward_to.as_deref(), &path, "ForwardTo")?;
                    check_target(
                        &names,
                        props.forward_dead_lettered_messages_to.as_deref(),
                        &path,
                        "ForwardDeadLetteredMessagesTo",
                    )?;
                }
            }
        }
        Ok(out)
    }
}

fn claim_name(names: &mut Vec<String>, name: &str, path: &str) -> Result<(), Error> {
    let key = name.to_ascii_lowercase();
    if names.contains(&key) {
        return Err(Error::Config {
            path: path.to_owned(),
            message: format!("{name:?} is declared twice (names are case-insensitive)"),
        });
    }
    names.push(key);
    Ok(())
}

fn check_target(
    names: &[String],
    to: Option<&str>,
    path: &str,
    property: &str,
) -> Result<(), Error> {
    match to {
        Some(to) if !names.contains(&to.to_ascii_lowercase()) => Err(Error::Config {
            path: format!("{path}.{property}"),
            message: format!("{to:?} is not a queue or topic declared in this file"),
        }),
        _ => Ok(()),
    }
}

/// A JSON value read with duplicate object keys rejected: serde_json keeps the last of them
/// silently, so a second `LockDuration` would hide the first one a reader of the file sees.
struct Strict(Json);

impl<'de> Deserialize<'de> for Strict {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(StrictVisitor).map(Strict)
    }
}

/// Builds a [`Strict`] value.
struct StrictVisitor;

impl<'de> Visitor<'de> for StrictVisitor {
    type Value = Json;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E>(self, b: bool) -> Result<Json, E> {
        Ok(Json::Bool(b))
    }

    fn visit_i64<E>(self, n: i64) -> Result<Json, E> {
        Ok(Json::from(n))
    }

    fn visit_u64<E>(self, n: u64) -> Result<Json, E> {
        Ok(Json::from(n))
    }

    fn visit_f64<E>(self, x: f64) -> Result<Json, E> {
        Ok(serde_json::Number::from_f64(x).map_or(Json::Null, Json::Number))
    }

    fn visit_str<E>(self, s: &str) -> Result<Json, E> {
        Ok(Json::String(s.to_owned()))
    }

    fn visit_string<E>(self, s: String) -> Result<Json, E> {
        Ok(Json::String(s))
    }

    fn visit_unit<E>(self) -> Result<Json, E> {
        Ok(Json::Null)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Json, A::Error> {
        let mut out = Vec::new();
        while let Some(Strict(v)) = seq.next_element()? {
            out.push(v);
        }
        Ok(Json::Array(out))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Json, A::Error> {
        let mut out = Map::new();
        while let Some(key) = map.next_key::<String>()? {
            if out.contains_key(&key) {
                return Err(de::Error::custom(format!("duplicate key {key:?}")));
            }
            let Strict(v) = map.next_value()?;
            out.insert(key, v);
        }
        Ok(Json::Object(out))
    }
}

/// Removes `//` and `/* */` comments outside strings, keeping line breaks so that serde_json's
/// line numbers still point at the right line.
fn strip_comments(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    let mut in_string = false;
    while let Some(c) = chars.next() {
        if in_string {
            out.push(c);
            if c == '\\' {
                if let Some(escaped) = chars.next() {
                    out.push(escaped);
                }
            } else if c == '"' {
                in_string = false;
            }
            continue;
        }
        match (c, chars.peek()) {
            ('"', _) => {
                in_string = true;
                out.push(c);
            }
            ('/', Some('/')) => {
                for c in chars.by_ref() {
                    if c == '\n' {
                        out.push('\n');
                        break;
                    }
                }
            }
            ('/', Some('*')) => {
                chars.next();
                let mut prev = '\0';
                for c in chars.by_ref() {
                    if c == '\n' {
                        out.push('\n');
                    }
                    if prev == '*' && c == '/' {
                        break;
                    }
                    prev = c;
                }
                out.push(' ');
            }
            _ => out.push(c),
        }
    }
    out
}

fn config_err(path: &str, message: impl Into<String>) -> Error {
    Error::Config { path: path.to_owned(), message: message.into() }
}

fn json_type(v: &Json) -> &'static str {
    match v {
        Json::Null => "null",
        Json::Bool(_) => "a boolean",
        Json::Number(_) => "a number",
        Json::String(_) => "a string",
        Json::Array(_) => "an array",
        Json::Object(_) => "an object",
    }
}

/// An object whose keys are checked against the allowed ones.
struct Obj<'a> {
    map: &'a Map<String, Json>,
    path: String,
}

impl<'a> Obj<'a> {
    fn new(v: &'a Json, path: &str, allowed: &[&str]) -> Result<Self, Error> {
        let map = v.as_object().ok_or_else(|| {
            config_err(path, format!("expected an object, found {}", json_type(v)))
        })?;
        for key in map.keys() {
            if !allowed.contains(&key.as_str()) {
                return Err(config_err(
                    &format!("{path}.{key}"),
                    format!("unknown property {key:?} (expected one of: {})", allowed.join(", ")),
                ));
            }
        }
        Ok(Self { map, path: path.to_owned() })
    }

    fn at(&self, key: &str) -> String {
        format!("{}.{key}", self.path)
    }

    fn get(&self, key: &str) -> Option<&'a Json> {
        self.map.get(key)
    }

    fn required(&self, key: &str) -> Result<&'a Json, Error> {
        self.get(key).ok_or_else(|| config_err(&self.at(key), "required property is missing"))
    }

    fn string(&self, key: &str) -> Result<Option<&'a str>, Error> {
        match self.get(key) {
            None => Ok(None),
            Some(Json::String(s)) => Ok(Some(s)),
            Some(v) => {
                Err(config_err(&self.at(key), format!("expected a string, found {}", json_type(v))))
            }
        }
    }

    fn required_string(&self, key: &str) -> Result<&'a str, Error> {
        self.required(key)?;
        self.string(key).map(|s| s.unwrap_or_default())
    }

    fn bool(&self, key: &str) -> Result<Option<bool>, Error> {
        match self.get(key) {
            None => Ok(None),
            Some(Json::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(config_err(
                &self.at(key),
                format!("expected a boolean, found {}", json_type(v)),
            )),
        }
    }

    fn duration(&self, key: &str) -> Result<Option<Duration>, Error> {
        match self.string(key)? {
            None => Ok(None),
            Some(s) => parse_duration(s).map(Some).map_err(|m| config_err(&self.at(key), m)),
        }
    }

    fn u32(&self, key: &str) -> Result<Option<u32>, Error> {
        match self.get(key) {
            None => Ok(None),
            Some(Json::Number(n)) => {
                n.as_u64().and_then(|n| u32::try_from(n).ok()).map(Some).ok_or_else(|| {
                    config_err(&self.at(key), format!("expected a whole number, found {n}"))
                })
            }
            Some(v) => {
                Err(config_err(&self.at(key), format!("expected a number, found {}", json_type(v))))
            }
        }
    }

    fn array(&self, key: &str) -> Result<&'a [Json], Error> {
        match self.get(key) {
            None => Ok(&[]),
            Some(Json::Array(a)) => Ok(a),
            Some(v) => {
                Err(config_err(&self.at(key), format!("expected an array, found {}", json_type(v))))
            }
        }
    }

    /// An optional `ForwardTo`-style name, where the empty string means none.
    fn forward(&self, key: &str) -> Result<Option<String>, Error> {
        match self.string(key)? {
            None | Some("") => Ok(None),
            Some(s) => {
                validate_entity_name(s).map_err(|e| config_err(&self.at(key), e.to_string()))?;
                Ok(Some(s.to_owned()))
            }
        }
    }
}

/// Maps a property error from `validate` onto the JSON path of the property.
fn property_err(props_path: &str, e: Error) -> Error {
    match e {
        Error::InvalidProperty { property, reason } => {
            config_err(&format!("{props_path}.{property}"), reason)
        }
        other => config_err(props_path, other.to_string()),
    }
}

fn parse_root(root: &Json) -> Result<Config, Error> {
    let top = Obj::new(root, "$", &["UserConfig"])?;
    let user = Obj::new(top.required("UserConfig")?, "UserConfig", &["Namespaces", "Logging"])?;
    let logging = match user.get("Logging") {
        None => None,
        Some(v) => {
            let l = Obj::new(v, "UserConfig.Logging", &["Type"])?;
            l.string("Type")?.map(str::to_owned)
        }
    };
    let mut namespaces = Vec::new();
    user.required("Namespaces")?;
    for (n, ns) in user.array("Namespaces")?.iter().enumerate() {
        let path = format!("UserConfig.Namespaces[{n}]");
        let ns = Obj::new(ns, &path, &["Name", "Queues", "Topics"])?;
        let name = ns.required_string("Name")?.to_owned();
        let mut queues = Vec::new();
        for (q, queue) in ns.array("Queues")?.iter().enumerate() {
            queues.push(parse_queue(queue, &format!("{path}.Queues[{q}]"))?);
        }
        let mut topics = Vec::new();
        for (t, topic) in ns.array("Topics")?.iter().enumerate() {
            topics.push(parse_topic(topic, &format!("{path}.Topics[{t}]"))?);
        }
        namespaces.push(NamespaceConfig { name, queues, topics });
    }
    Ok(Config { namespaces, logging })
}

fn entity_name(o: &Obj<'_>, subscription: bool) -> Result<String, Error> {
    let name = o.required_string("Name")?;
    let checked =
        if subscription { validate_subscription_name(name) } else { validate_entity_name(name) };
    checked.map_err(|e| config_err(&o.at("Name"), e.to_string()))?;
    Ok(name.to_owned())
}

/// The `Properties` a queue accepts, in the order an error lists them.
const QUEUE_KEYS: &[&str] = &[
    "DeadLetteringOnMessageExpiration",
    "DefaultMessageTimeToLive",
    "DuplicateDetectionHistoryTimeWindow",
    "ForwardDeadLetteredMessagesTo",
    "ForwardTo",
    "LockDuration",
    "MaxDeliveryCount",
    "MaxSizeInMegabytes",
    "RequiresDuplicateDetection",
    "RequiresSession",
];

/// The `Properties` a topic accepts.
const TOPIC_KEYS: &[&str] = &[
    "DefaultMessageTimeToLive",
    "DuplicateDetectionHistoryTimeWindow",
    "MaxSizeInMegabytes",
    "RequiresDuplicateDetection",
];

/// The `Properties` a subscription accepts.
const SUBSCRIPTION_KEYS: &[&str] = &[
    "DeadLetteringOnMessageExpiration",
    "DefaultMessageTimeToLive",
    "ForwardDeadLetteredMessagesTo",
    "ForwardTo",
    "LockDuration",
    "MaxDeliveryCount",
    "RequiresSession",
];

/// The properties an entity of a `Config.json` has where the file leaves them out: the
/// emulator's defaults (`MaxDeliveryCount` 3, `DefaultMessageTimeToLive` one hour,
/// `DuplicateDetectionHistoryTimeWindow` 20 seconds), so that the emulator's files behave the
/// same here. Entities created through the API start from Service Bus's own defaults instead
/// (10 deliveries, no time to live, a 10-minute window), as they do with the emulator.
pub fn emulator_defaults() -> QueueProperties {
    QueueProperties {
        max_delivery_count: EMULATOR_MAX_DELIVERY_COUNT,
        default_message_time_to_live: Some(EMULATOR_TIME_TO_LIVE),
        duplicate_detection_history_time_window: EMULATOR_DUPLICATE_DETECTION_WINDOW,
        ..QueueProperties::default()
    }
}

/// `MaxDeliveryCount` of a `Config.json` entity that does not set it.
pub const EMULATOR_MAX_DELIVERY_COUNT: u32 = 3;
/// `DefaultMessageTimeToLive` of a `Config.json` entity that does not set it.
pub const EMULATOR_TIME_TO_LIVE: Duration = Duration::from_secs(3600);
/// `DuplicateDetectionHistoryTimeWindow` of a `Config.json` entity that does not set it.
pub const EMULATOR_DUPLICATE_DETECTION_WINDOW: Duration = Duration::from_secs(20);

/// Reads the `Properties` object of an entity (the emulator's defaults,
/// [`emulator_defaults`], when it is absent), accepting only `keys`, and checks the result with
/// `validate`. One reader serves the three kinds: a queue
/// has every property a topic or a subscription has, so the object is read into a queue's
/// properties and `from` keeps the kind's own.
fn read_properties<P>(
    o: &Obj<'_>,
    keys: &[&str],
    from: impl FnOnce(QueueProperties) -> P,
    validate: impl FnOnce(&P) -> Result<(), Error>,
) -> Result<P, Error> {
    let mut props = emulator_defaults();
    let Some(p) = o.get("Properties") else { return Ok(from(props)) };
    let pp = o.at("Properties");
    let p = Obj::new(p, &pp, keys)?;
    if let Some(b) = p.bool("DeadLetteringOnMessageExpiration")? {
        props.dead_lettering_on_message_expiration = b;
    }
    if let Some(d) = p.duration("DefaultMessageTimeToLive")? {
        props.default_message_time_to_live = Some(d);
    }
    if let Some(d) = p.duration("DuplicateDetectionHistoryTimeWindow")? {
        props.duplicate_detection_history_time_window = d;
    }
    props.forward_dead_lettered_messages_to = p.forward("ForwardDeadLetteredMessagesTo")?;
    props.forward_to = p.forward("ForwardTo")?;
    if let Some(d) = p.duration("LockDuration")? {
        props.lock_duration = d;
    }
    if let Some(n) = p.u32("MaxDeliveryCount")? {
        props.max_delivery_count = n;
    }
    if let Some(n) = p.u32("MaxSizeInMegabytes")? {
        props.max_size_in_megabytes = u64::from(n);
    }
    if let Some(b) = p.bool("RequiresDuplicateDetection")? {
        props.requires_duplicate_detection = b;
    }
    if let Some(b) = p.bool("RequiresSession")? {
        props.requires_session = b;
    }
    let props = from(props);
    validate(&props).map_err(|e| property_err(&pp, e))?;
    Ok(props)
}

fn parse_queue(v: &Json, path: &str) -> Result<(String, QueueProperties), Error> {
    let o = Obj::new(v, path, &["Name", "Properties"])?;
    let name = entity_name(&o, false)?;
    let props = read_properties(&o, QUEUE_KEYS, |q| q, QueueProperties::validate)?;
    Ok((name, props))
}

fn parse_topic(v: &Json, path: &str) -> Result<TopicConfig, Error> {
    let o = Obj::new(v, path, &["Name", "Properties", "Subscriptions"])?;
    let name = entity_name(&o, false)?;
    let from = |q: QueueProperties| TopicProperties {
        default_message_time_to_live: q.default_message_time_to_live,
        requires_duplicate_detection: q.requires_duplicate_detection,
        duplicate_detection_history_time_window: q.duplicate_detection_history_time_window,
        max_size_in_megabytes: q.max_size_in_megabytes,
    };
    let properties = read_properties(&o, TOPIC_KEYS, from, TopicProperties::validate)?;
    let mut subscriptions = Vec::new();
    for (s, sub) in o.array("Subscriptions")?.iter().enumerate() {
        subscriptions.push(parse_subscription(sub, &format!("{path}.Subscriptions[{s}]"))?);
    }
    Ok(TopicConfig { name, properties, subscriptions })
}

fn parse_subscription(
    v: &Json,
    path: &str,
) -> Result<(String, SubscriptionProperties, Vec<Rule>), Error> {
    let o = Obj::new(v, path, &["Name", "Properties", "Rules"])?;
    let name = entity_name(&o, true)?;
    let from = |q: QueueProperties| SubscriptionProperties {
        lock_duration: q.lock_duration,
        max_delivery_count: q.max_delivery_count,
        default_message_time_to_live: q.default_message_time_to_live,
        dead_lettering_on_message_expiration: q.dead_lettering_on_message_expiration,
        requires_session: q.requires_session,
        forward_to: q.forward_to,
        forward_dead_lettered_messages_to: q.forward_dead_lettered_messages_to,
    };
    let props = read_properties(&o, SUBSCRIPTION_KEYS, from, SubscriptionProperties::validate)?;
    let mut rules: Vec<Rule> = Vec::new();
    for (r, rule) in o.array("Rules")?.iter().enumerate() {
        let rule_path = format!("{path}.Rules[{r}]");
        let rule = parse_rule(rule, &rule_path)?;
        if rules.iter().any(|x| x.name.eq_ignore_ascii_case(&rule.name)) {
            return Err(config_err(
                &format!("{rule_path}.Name"),
                format!("rule {:?} is declared twice", rule.name),
            ));
        }
        rules.push(rule);
    }
    Ok((name, props, rules))
}

fn parse_rule(v: &Json, path: &str) -> Result<Rule, Error> {
    let o = Obj::new(v, path, &["Name", "Properties"])?;
    let name = entity_name(&o, true)?;
    let pp = o.at("Properties");
    let p = Obj::new(
        o.required("Properties")?,
        &pp,
        &["FilterType", "CorrelationFilter", "SqlFilter", "Action"],
    )?;
    let filter = match p.required_string("FilterType")? {
        "Correlation" => {
            let cp = p.at("CorrelationFilter");
            let c = Obj::new(
                p.required("CorrelationFilter")?,
                &cp,
                &[
                    "ContentType",
                    "CorrelationId",
                    "Label",
                    "MessageId",
                    "ReplyTo",
                    "ReplyToSessionId",
                    "SessionId",
                    "To",
                    "Properties",
                ],
            )?;
            // An empty string is how the emulator's files leave a field unset.
            let field = |key: &str| -> Result<Option<String>, Error> {
                Ok(c.string(key)?.filter(|s| !s.is_empty()).map(str::to_owned))
            };
            let mut filter = CorrelationFilter {
                message_id: field("MessageId")?,
                correlation_id: field("CorrelationId")?,
                session_id: field("SessionId")?,
                subject: field("Label")?,
                to: field("To")?,
                reply_to: field("ReplyTo")?,
                reply_to_session_id: field("ReplyToSessionId")?,
                content_type: field("ContentType")?,
                properties: Properties::new(),
            };
            if let Some(props) = c.get("Properties") {
                let props_path = c.at("Properties");
                let map = props.as_object().ok_or_else(|| {
                    config_err(
                        &props_path,
                        format!("expected an object, found {}", json_type(props)),
                    )
                })?;
                for (k, v) in map {
                    let value = match v {
                        Json::String(s) => Value::String(s.clone()),
                        Json::Bool(b) => Value::Bool(*b),
                        Json::Number(n) => match (n.as_i64(), n.as_f64()) {
                            (Some(i), _) => Value::Long(i),
                            (None, Some(x)) => Value::Double(x),
                            (None, None) => {
                                return Err(config_err(
                                    &format!("{props_path}.{k}"),
                                    "number out of range",
                                ));
                            }
                        },
                        other => {
                            return Err(config_err(
                                &format!("{props_path}.{k}"),
                                format!(
                                    "expected a string, number or boolean, found {}",
                                    json_type(other)
                                ),
                            ));
                        }
                    };
                    filter.properties.insert(k.clone(), value);
                }
            }
            Filter::Correlation(filter)
        }
        "Sql" => {
            let sp = p.at("SqlFilter");
            let s = Obj::new(p.required("SqlFilter")?, &sp, &["SqlExpression"])?;
            let text = s.required_string("SqlExpression")?;
            let filter = SqlFilter::parse(text)
                .map_err(|e| config_err(&s.at("SqlExpression"), format!("{e} in {text:?}")))?;
            Filter::Sql(filter)
        }
        other => {
            return Err(config_err(
                &p.at("FilterType"),
                format!("unknown filter type {other:?} (expected \"Correlation\" or \"Sql\")"),
            ));
        }
    };
    // Both filter types may carry an action, as in the emulator's own sample.
    let action = match p.get("Action") {
        Some(action) => {
            let a = Obj::new(action, &p.at("Action"), &["SqlExpression"])?;
            let text = a.required_string("SqlExpression")?;
            let parsed = SqlAction::parse(text)
                .map_err(|e| config_err(&a.at("SqlExpression"), format!("{e} in {text:?}")))?;
            Some(parsed)
        }
        None => None,
    };
    Ok(Rule { name, filter, action })
}
