//! The Service Bus administration API (ATOM over HTTP) that `ServiceBusAdministrationClient`
//! speaks: create (PUT), get (GET), update (PUT with `If-Match: *`), list and delete of
//! queues, topics, subscriptions and rules, with runtime counts in every description.
//!
//! Every request carries `Authorization: SharedAccessSignature …`, checked with the server's
//! keys as `$cbs` checks a token (signature, expiry on the server's clock, audience, the path it
//! covers) and needing the `Manage` claim, as Service Bus does; a `ForwardTo` or
//! `ForwardDeadLetteredMessagesTo` also needs a token with `Send` on the target in
//! `ServiceBusSupplementaryAuthorization` / `ServiceBusDlqSupplementaryAuthorization`.
//! Entities created here get the Service Bus defaults for what the body leaves out.

pub(crate) mod xml;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Mutex;

use twice::Timestamp;
use twice_broker::MessageCounts;
use twice_broker::config::{
    EntityDefinition, QueueProperties, SubscriptionProperties, TopicProperties,
};

use crate::backend::{Backend, BackendError};
use crate::grants::{Grants, audience_is_ours, server_ports};
pub(crate) use crate::request::Request;
use crate::sas::Claim;
use crate::shared::Shared;
use xml::{BadRequest, Description, FeedEntry, Times};

/// The most entries a list returns at once, as Service Bus.
const MAX_TOP: usize = 100;

impl Request<'_> {
    fn query(&self, name: &str) -> Option<usize> {
        self.query.split('&').find_map(|kv| {
            let (k, v) = kv.split_once('=')?;
            let k = crate::sas::url_decode(k)?;
            (k == name).then(|| v.parse().ok()).flatten()
        })
    }
}

/// A response: status line text, content type and body.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Response {
    pub(crate) status: &'static str,
    pub(crate) content_type: &'static str,
    pub(crate) body: String,
}

const ENTRY: &str = "application/atom+xml;type=entry;charset=utf-8";
const FEED: &str = "application/atom+xml;type=feed;charset=utf-8";

fn error(code: u16, detail: impl AsRef<str>) -> Response {
    let status = match code {
        400 => "400 Bad Request",
        401 => "401 Unauthorized",
        403 => "403 Forbidden",
        404 => "404 Not Found",
        405 => "405 Method Not Allowed",
        409 => "409 Conflict",
        501 => "501 Not Implemented",
        503 => "503 Service Unavailable",
        _ => "500 Internal Server Error",
    };
    Response {
        status,
        content_type: "application/xml; charset=utf-8",
        body: xml::error(code, detail.as_ref()),
    }
}

fn backend_error(e: &BackendError) -> Response {
    let code = match e {
        BackendError::EntityNotFound(_) | BackendError::MessageNotFound(_) => 404,
        BackendError::AlreadyExists(_) => 409,
        // As Service Bus answers a create past a namespace quota.
        BackendError::QuotaExceeded(why) => return error(403, format!("QuotaExceeded: {why}")),
        BackendError::Invalid(_) | BackendError::MessageSizeExceeded(_) => 400,
        BackendError::Unsupported(_) => 501,
        BackendError::Unavailable(_) | BackendError::StorageFailed(_) => 503,
        _ => 500,
    };
    error(code, e.to_string())
}

impl From<BadRequest> for Response {
    fn from(e: BadRequest) -> Self {
        error(400, e.0)
    }
}

/// What the administration API remembers beside the broker: when this server saw each
/// entity created and changed (the broker keeps no times; an entity this server did not
/// create or change reports the time the server started).
#[derive(Debug)]
pub(crate) struct Admin {
    started: Timestamp,
    /// By lowercase path. A short section with no `.await` inside.
    times: Mutex<HashMap<String, Times>>,
}

impl Admin {
    pub(crate) fn new(started: Timestamp) -> Self {
        Self { started, times: Mutex::new(HashMap::new()) }
    }

    fn times(&self, path: &str) -> Times {
        let times = self.times.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        times.get(&path.to_ascii_lowercase()).copied().unwrap_or(Times {
            created: self.started,
            updated: self.started,
            accessed: self.started,
        })
    }

    fn touch(&self, path: &str, now: Timestamp, created: bool) {
        let mut times = self.times.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let key = path.to_ascii_lowercase();
        let old = times.get(&key).copied();
        let t = match (created, old) {
            (false, Some(t)) => Times { updated: now, accessed: now, ..t },
            (false, None) => Times { created: self.started, updated: now, accessed: now },
            (true, _) => Times { created: now, updated: now, accessed: now },
        };
        times.insert(key, t);
    }

    fn forget(&self, path: &str) {
        let mut times = self.times.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let key = path.to_ascii_lowercase();
        let under = format!("{key}/");
        times.retain(|k, _| k != &key && !k.starts_with(&under));
    }
}

/// Checks a `SharedAccessSignature` header: valid with a configured key, not expired on the
/// server's clock, for this host (when it names one: supplementary tokens may name just the
/// entity), covering `path`, and with `need`.
fn authorize<B>(
    shared: &Shared<B>,
    addr: SocketAddr,
    token: Option<&str>,
    path: &str,
    need: Claim,
    header: &str,
) -> Result<(), Response> {
    let Some(token) = token else {
        return Err(error(401, format!("the request has no {header} header")));
    };
    let now = shared.options.clock.now().as_millis().div_euclid(1000);
    let opts = &shared.options;
    let grant = opts.keys.validate(token, now).map_err(|e| error(401, format!("{header}: {e}")))?;
    if grant.resource.contains("://")
        && !audience_is_ours(&grant.resource, &opts.hostname, addr, &server_ports(opts, addr))
    {
        return Err(error(401, format!("{header}: the token's audience is not this namespace")));
    }
    let resource = grant.resource.split('?').next().unwrap_or_default();
    let mut grants = Grants::default();
    let claims = opts.keys.claims(&grant.key_name);
    grants.insert(crate::address::normalize(resource), grant.expiry, claims, now);
    if !grants.allows(&path.to_ascii_lowercase(), now, Some(need)) {
        return Err(error(401, format!("{header}: the token does not grant {need:?} on '{path}'")));
    }
    Ok(())
}

/// What a request path names.
#[derive(Debug, PartialEq, Eq)]
enum Target {
    /// `$Resources/queues` or `$Resources/topics`.
    List(&'static str),
    /// A queue or topic.
    Entity(String),
    /// `<topic>/Subscriptions`.
    Subscriptions(String),
    /// `<topic>/Subscriptions/<name>`.
    Subscription(String, String),
    /// `<topic>/Subscriptions/<name>/Rules`.
    Rules(String, String),
    /// `<topic>/Subscriptions/<name>/Rules/<rule>`.
    Rule(String, String, String),
    /// `$reset`: every entity emptied (twice's own; no entity name can hold a `$`).
    Reset,
}

impl Target {
    fn parse(raw: &str) -> Option<Self> {
        let path = crate::sas::url_decode(raw)?;
        let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
        if segments.iter().any(|s| s.is_empty()) {
            return None;
        }
        if let [first, kind] = segments.as_slice()
            && first.eq_ignore_ascii_case("$Resources")
        {
            return match kind.to_ascii_lowercase().as_str() {
                "queues" => Some(Target::List("queues")),
                "topics" => Some(Target::List("topics")),
                _ => None,
            };
        }
        if let [only] = segments.as_slice()
            && only.eq_ignore_ascii_case("$reset")
        {
            return Some(Target::Reset);
        }
        let Some(at) = segments.iter().position(|s| s.eq_ignore_ascii_case("subscriptions")) else {
            return Some(Target::Entity(segments.join("/")));
        };
        let topic = segments[..at].join("/");
        if topic.is_empty() {
            return None;
        }
        match &segments[at + 1..] {
            [] => Some(Target::Subscriptions(topic)),
            [sub] => Some(Target::Subscription(topic, (*sub).to_owned())),
            [sub, rules] if rules.eq_ignore_ascii_case("rules") => {
                Some(Target::Rules(topic, (*sub).to_owned()))
            }
            [sub, rules, rule] if rules.eq_ignore_ascii_case("rules") => {
                Some(Target::Rule(topic, (*sub).to_owned(), (*rule).to_owned()))
            }
            _ => None,
        }
    }

    /// The path a token must cover: the resource itself or one it is under.
    fn auth_path(&self) -> String {
        match self {
            Target::List(kind) => format!("$resources/{kind}"),
            Target::Entity(p) => p.clone(),
            Target::Subscriptions(t) => format!("{t}/subscriptions"),
            Target::Subscription(t, s) => format!("{t}/subscriptions/{s}"),
            Target::Rules(t, s) => format!("{t}/subscriptions/{s}/rules"),
            Target::Rule(t, s, r) => format!("{t}/subscriptions/{s}/rules/{r}"),
            // Only a token for the whole namespace covers it.
            Target::Reset => "$reset".to_owned(),
        }
    }
}

/// Handles one request of the administration API. `addr` is the HTTP listener's address (a
/// token for `localhost` is ours when it listens on loopback).
///
/// # Cancel safety
///
/// Not cancel safe: a request dropped half way may have changed an entity without answering.
pub(crate) async fn handle<B: Backend>(
    shared: &Shared<B>,
    admin: &Admin,
    addr: SocketAddr,
    req: &Request<'_>,
) -> Response {
    let Some(target) = Target::parse(req.path) else {
        return error(404, format!("no resource at '{}'", req.path));
    };
    if let Err(r) = authorize(
        shared,
        addr,
        req.header("authorization"),
        &target.auth_path(),
        Claim::Manage,
        "Authorization",
    ) {
        return r;
    }
    let host = req.header("host").unwrap_or("localhost");
    let base = format!("https://{host}");
    let ctx = Ctx { shared, admin, addr, base, req };
    let result = match (&target, req.method) {
        (Target::List(kind), "GET") => ctx.list(kind).await,
        (Target::Entity(path), "GET") => ctx.get_entity(path, false).await,
        (Target::Entity(path), "PUT") => ctx.put_entity(path).await,
        (Target::Entity(path), "DELETE") => ctx.delete(path).await,
        (Target::Subscriptions(topic), "GET") => ctx.list_subscriptions(topic).await,
        (Target::Subscription(t, s), "GET") => ctx.get_entity(&sub_path(t, s), true).await,
        (Target::Subscription(t, s), "PUT") => ctx.put_subscription(t, s).await,
        (Target::Subscription(t, s), "DELETE") => ctx.delete(&sub_path(t, s)).await,
        (Target::Rules(t, s), "GET") => ctx.list_rules(t, s).await,
        (Target::Rule(t, s, r), "GET") => ctx.get_rule(t, s, r).await,
        (Target::Rule(t, s, r), "PUT") => ctx.put_rule(t, s, r).await,
        (Target::Rule(t, s, r), "DELETE") => ctx.delete_rule(t, s, r).await,
        (Target::Reset, "POST") => ctx.reset().await,
        _ => Err(error(405, format!("{} is not allowed on '{}'", req.method, req.path))),
    };
    result.unwrap_or_else(|r| r)
}

fn sub_path(topic: &str, sub: &str) -> String {
    format!("{topic}/Subscriptions/{sub}")
}

struct Ctx<'a, B> {
    shared: &'a Shared<B>,
    admin: &'a Admin,
    addr: SocketAddr,
    base: String,
    req: &'a Request<'a>,
}

type Reply = Result<Response, Response>;

impl<B: Backend> Ctx<'_, B> {
    fn now(&self) -> Timestamp {
        self.shared.options.clock.now()
    }

    fn is_update(&self) -> bool {
        self.req.header("if-match").is_some()
    }

    async fn counts(&self, path: &str) -> MessageCounts {
        self.shared.backend.admin_counts(path).await.unwrap_or_default()
    }

    /// The description of an entity, and the title and path its entry carries.
    async fn describe(
        &self,
        def: &EntityDefinition,
        all: Option<&[EntityDefinition]>,
    ) -> FeedEntry {
        let path = def.path();
        let times = self.admin.times(&path);
        let counts = self.counts(&path).await;
        let (title, description) = match def {
            EntityDefinition::Queue { name, properties } => {
                (name.clone(), xml::queue(properties, &counts, &times))
            }
            EntityDefinition::Topic { name, properties } => {
                let subscriptions = match all {
                    Some(all) => subscriptions_of(all, name),
                    None => match self.shared.backend.admin_list().await {
                        Ok(all) => subscriptions_of(&all, name),
                        Err(_) => 0,
                    },
                };
                (name.clone(), xml::topic(properties, &counts, &times, subscriptions))
            }
            EntityDefinition::Subscription { name, properties, .. } => {
                (name.clone(), xml::subscription(properties, &counts, &times))
            }
            _ => (path.clone(), String::new()),
        };
        FeedEntry { path, title, times, description }
    }

    fn entry(&self, e: &FeedEntry, status: &'static str) -> Response {
        Response {
            status,
            content_type: ENTRY,
            body: xml::entry(&self.base, &e.path, &e.title, &e.times, &e.description),
        }
    }

    async fn get_entity(&self, path: &str, subscription: bool) -> Reply {
        let def = self.shared.backend.admin_get(path).await.map_err(|e| backend_error(&e))?;
        if subscription != matches!(def, EntityDefinition::Subscription { .. }) {
            return Err(error(404, format!("the messaging entity '{path}' could not be found")));
        }
        let e = self.describe(&def, None).await;
        Ok(self.entry(&e, "200 OK"))
    }

    fn page(&self) -> (usize, usize) {
        let skip = self.req.query("$skip").unwrap_or(0);
        let top = self.req.query("$top").unwrap_or(MAX_TOP).clamp(1, MAX_TOP);
        (skip, top)
    }

    fn feed(&self, path: &str, title: &str, entries: &[FeedEntry], total: usize) -> Response {
        let (skip, top) = self.page();
        let next = (skip + top < total).then_some((skip + top, top));
        Response {
            status: "200 OK",
            content_type: FEED,
            body: xml::feed(&self.base, path, title, self.now(), entries, next),
        }
    }

    async fn list(&self, kind: &str) -> Reply {
        let all = self.shared.backend.admin_list().await.map_err(|e| backend_error(&e))?;
        let chosen: Vec<&EntityDefinition> = all
            .iter()
            .filter(|d| match kind {
                "queues" => matches!(d, EntityDefinition::Queue { .. }),
                _ => matches!(d, EntityDefinition::Topic { .. }),
            })
            .collect();
        let (skip, top) = self.page();
        let mut entries = Vec::new();
        for d in chosen.iter().skip(skip).take(top) {
            entries.push(self.describe(d, Some(&all)).await);
        }
        let title = if kind == "queues" { "Queues" } else { "Topics" };
        Ok(self.feed(&format!("$Resources/{kind}"), title, &entries, chosen.len()))
    }

    async fn list_subscriptions(&self, topic: &str) -> Reply {
        let all = self.shared.backend.admin_list().await.map_err(|e| backend_error(&e))?;
        if !all
            .iter()
            .any(|d| matches!(d, EntityDefinition::Topic { name, .. } if name.eq_ignore_ascii_case(topic)))
        {
            return Err(error(404, format!("the messaging entity '{topic}' could not be found")));
        }
        let subs: Vec<&EntityDefinition> = all
            .iter()
            .filter(|d| {
                matches!(d, EntityDefinition::Subscription { topic: t, .. } if t.eq_ignore_ascii_case(topic))
            })
            .collect();
        let (skip, top) = self.page();
        let mut entries = Vec::new();
        for d in subs.iter().skip(skip).take(top) {
            entries.push(self.describe(d, None).await);
        }
        Ok(self.feed(&format!("{topic}/Subscriptions"), "Subscriptions", &entries, subs.len()))
    }

    /// Checks the supplementary tokens a forwarding entity needs, for targets that change.
    fn check_forwarding(
        &self,
        forward_to: Option<&String>,
        dead_letters_to: Option<&String>,
        old: (Option<&String>, Option<&String>),
    ) -> Result<(), Response> {
        for (target, was, header, name) in [
            (
                forward_to,
                old.0,
                "servicebussupplementaryauthorization",
                "ServiceBusSupplementaryAuthorization",
            ),
            (
                dead_letters_to,
                old.1,
                "servicebusdlqsupplementaryauthorization",
                "ServiceBusDlqSupplementaryAuthorization",
            ),
        ] {
            let Some(target) = target else { continue };
            if was.is_some_and(|w| w.eq_ignore_ascii_case(target)) {
                continue;
            }
            authorize(self.shared, self.addr, self.req.header(header), target, Claim::Send, name)?;
        }
        Ok(())
    }

    async fn put_entity(&self, path: &str) -> Reply {
        let description = xml::description(self.req.body)?;
        let existing = if self.is_update() {
            Some(self.shared.backend.admin_get(path).await.map_err(|e| backend_error(&e))?)
        } else {
            None
        };
        let def = match (description, existing) {
            (Description::Queue(d), None) => {
                let mut p = QueueProperties::default();
                xml::apply_queue(&d, &mut p)?;
                self.check_forwarding(
                    p.forward_to.as_ref(),
                    p.forward_dead_lettered_messages_to.as_ref(),
                    (None, None),
                )?;
                EntityDefinition::queue(path, p)
            }
            (Description::Queue(d), Some(EntityDefinition::Queue { name, properties })) => {
                let mut p = properties.clone();
                xml::apply_queue(&d, &mut p)?;
                self.check_forwarding(
                    p.forward_to.as_ref(),
                    p.forward_dead_lettered_messages_to.as_ref(),
                    (
                        properties.forward_to.as_ref(),
                        properties.forward_dead_lettered_messages_to.as_ref(),
                    ),
                )?;
                EntityDefinition::queue(name, p)
            }
            (Description::Topic(d), None) => {
                let mut p = TopicProperties::default();
                xml::apply_topic(&d, &mut p)?;
                EntityDefinition::topic(path, p)
            }
            (Description::Topic(d), Some(EntityDefinition::Topic { name, mut properties })) => {
                xml::apply_topic(&d, &mut properties)?;
                EntityDefinition::topic(name, properties)
            }
            (Description::Queue(_) | Description::Topic(_), Some(_)) => {
                return Err(error(400, format!("'{path}' is a different kind of entity")));
            }
            _ => {
                return Err(error(
                    400,
                    "a queue or topic takes a QueueDescription or TopicDescription",
                ));
            }
        };
        self.store(def).await
    }

    /// Creates or updates `def` and answers with its entry (201 or 200).
    async fn store(&self, def: EntityDefinition) -> Reply {
        let path = def.path();
        let update = self.is_update();
        let backend = &self.shared.backend;
        if update { backend.admin_update(def).await } else { backend.admin_create(def).await }
            .map_err(|e| backend_error(&e))?;
        self.admin.touch(&path, self.now(), !update);
        let def = backend.admin_get(&path).await.map_err(|e| backend_error(&e))?;
        let e = self.describe(&def, None).await;
        Ok(self.entry(&e, if update { "200 OK" } else { "201 Created" }))
    }

    async fn put_subscription(&self, topic: &str, sub: &str) -> Reply {
        let Description::Subscription(d) = xml::description(self.req.body)? else {
            return Err(error(400, "a subscription takes a SubscriptionDescription"));
        };
        let path = sub_path(topic, sub);
        let def = if self.is_update() {
            let existing =
                self.shared.backend.admin_get(&path).await.map_err(|e| backend_error(&e))?;
            let EntityDefinition::Subscription { topic, name, properties, rules } = existing else {
                return Err(error(
                    404,
                    format!("the messaging entity '{path}' could not be found"),
                ));
            };
            let mut p = properties.clone();
            xml::apply_subscription(&d, &mut p)?;
            self.check_forwarding(
                p.forward_to.as_ref(),
                p.forward_dead_lettered_messages_to.as_ref(),
                (
                    properties.forward_to.as_ref(),
                    properties.forward_dead_lettered_messages_to.as_ref(),
                ),
            )?;
            EntityDefinition::subscription(topic, name, p, rules)
        } else {
            let mut p = SubscriptionProperties::default();
            let rule = xml::apply_subscription(&d, &mut p)?;
            self.check_forwarding(
                p.forward_to.as_ref(),
                p.forward_dead_lettered_messages_to.as_ref(),
                (None, None),
            )?;
            EntityDefinition::subscription(topic, sub, p, rule.into_iter().collect())
        };
        self.store(def).await
    }

    async fn delete(&self, path: &str) -> Reply {
        self.shared.backend.admin_delete(path).await.map_err(|e| backend_error(&e))?;
        self.admin.forget(path);
        self.shared.metrics.forget(path);
        Ok(Response { status: "200 OK", content_type: ENTRY, body: String::new() })
    }

    async fn reset(&self) -> Reply {
        let started = twice::Stopwatch::start();
        let entities = self.shared.backend.admin_reset().await.map_err(|e| backend_error(&e))?;
        let elapsed_ms = started.elapsed().as_secs_f64() * 1000.0;
        let body = serde_json::json!({ "entities": entities, "elapsed_ms": elapsed_ms });
        Ok(Response { status: "200 OK", content_type: "application/json", body: body.to_string() })
    }

    async fn rules(
        &self,
        topic: &str,
        sub: &str,
    ) -> Result<Vec<twice_broker::config::Rule>, Response> {
        let path = sub_path(topic, sub);
        match self.shared.backend.admin_get(&path).await.map_err(|e| backend_error(&e))? {
            EntityDefinition::Subscription { rules, .. } => Ok(rules),
            _ => Err(error(404, format!("the messaging entity '{path}' could not be found"))),
        }
    }

    fn rule_entry(&self, topic: &str, sub: &str, rule: &twice_broker::config::Rule) -> FeedEntry {
        let path = format!("{}/Rules/{}", sub_path(topic, sub), rule.name);
        let times = self.admin.times(&path);
        let description = xml::rule_description(rule, times.created);
        FeedEntry { path, title: rule.name.clone(), times, description }
    }

    async fn list_rules(&self, topic: &str, sub: &str) -> Reply {
        let rules = self.rules(topic, sub).await?;
        let (skip, top) = self.page();
        let entries: Vec<FeedEntry> =
            rules.iter().skip(skip).take(top).map(|r| self.rule_entry(topic, sub, r)).collect();
        Ok(self.feed(&format!("{}/Rules", sub_path(topic, sub)), "Rules", &entries, rules.len()))
    }

    async fn get_rule(&self, topic: &str, sub: &str, name: &str) -> Reply {
        let rules = self.rules(topic, sub).await?;
        let Some(rule) = rules.iter().find(|r| r.name.eq_ignore_ascii_case(name)) else {
            return Err(error(
                404,
                format!(
                    "the messaging entity '{}/Rules/{name}' could not be found",
                    sub_path(topic, sub)
                ),
            ));
        };
        Ok(self.entry(&self.rule_entry(topic, sub, rule), "200 OK"))
    }

    async fn put_rule(&self, topic: &str, sub: &str, name: &str) -> Reply {
        let Description::Rule(d) = xml::description(self.req.body)? else {
            return Err(error(400, "a rule takes a RuleDescription"));
        };
        let mut rule = xml::rule(&d, name)?;
        // The address names the rule, whatever the body says.
        rule.name = name.to_owned();
        twice_broker::config::validate_subscription_name(name)
            .map_err(|e| error(400, e.to_string()))?;
        let backend = &self.shared.backend;
        let update = self.is_update();
        if update {
            backend.admin_replace_rule(topic, sub, rule).await
        } else {
            backend.admin_create_rule(topic, sub, rule).await
        }
        .map_err(|e| backend_error(&e))?;
        let path = format!("{}/Rules/{name}", sub_path(topic, sub));
        self.admin.touch(&path, self.now(), !update);
        let rules = self.rules(topic, sub).await?;
        let Some(rule) = rules.iter().find(|r| r.name.eq_ignore_ascii_case(name)) else {
            return Err(error(404, format!("the rule '{path}' is gone")));
        };
        Ok(self.entry(
            &self.rule_entry(topic, sub, rule),
            if update { "200 OK" } else { "201 Created" },
        ))
    }

    async fn delete_rule(&self, topic: &str, sub: &str, name: &str) -> Reply {
        self.shared
            .backend
            .admin_delete_rule(topic, sub, name)
            .await
            .map_err(|e| backend_error(&e))?;
        self.admin.forget(&format!("{}/Rules/{name}", sub_path(topic, sub)));
        Ok(Response { status: "200 OK", content_type: ENTRY, body: String::new() })
    }
}

fn subscriptions_of(all: &[EntityDefinition], topic: &str) -> usize {
    all.iter()
        .filter(|d| matches!(d, EntityDefinition::Subscription { topic: t, .. } if t.eq_ignore_ascii_case(topic)))
        .count()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_name_their_targets_in_either_spelling() {
        let t = |p: &str| Target::parse(p);
        assert_eq!(t("/$Resources/queues"), Some(Target::List("queues")));
        assert_eq!(t("/%24Resources/Topics"), Some(Target::List("topics")));
        assert_eq!(t("/q1"), Some(Target::Entity("q1".into())));
        assert_eq!(t("/a/b"), Some(Target::Entity("a/b".into())));
        assert_eq!(t("/t1/subscriptions"), Some(Target::Subscriptions("t1".into())));
        assert_eq!(t("/t1/Subscriptions/s1"), Some(Target::Subscription("t1".into(), "s1".into())));
        assert_eq!(t("/t1/subscriptions/s1/rules"), Some(Target::Rules("t1".into(), "s1".into())));
        assert_eq!(
            t("/t1/Subscriptions/s1/Rules/r1"),
            Some(Target::Rule("t1".into(), "s1".into(), "r1".into()))
        );
        assert_eq!(t("/"), None);
        assert_eq!(t("/t1/subscriptions/s1/other"), None);
        assert_eq!(t("/subscriptions/s1"), None);
        assert_eq!(t("/$Resources/other"), None);
    }
}
