//! The checker: a scenario's history and its effects against the invariants.

use std::collections::{BTreeMap, HashMap, HashSet};

use super::probe::Event;
use super::{Failure, Invariant, Scenario};

/// A message the scenario sent, as the checker needs it.
#[derive(Clone, Debug)]
pub(super) struct Sent {
    pub(super) id: String,
    pub(super) poison: bool,
    /// Its key under each effect, in the order the effects were declared.
    pub(super) keys: Vec<Option<String>>,
}

/// An effect as the checker needs it.
#[derive(Clone, Debug)]
pub(super) struct EffectInfo {
    pub(super) name: String,
    /// Whether it is rows in the database (which only a commit may leave), rather than calls.
    pub(super) in_database: bool,
}

/// What the scenario left behind.
#[derive(Debug)]
pub(super) struct Observed<'a> {
    pub(super) events: &'a [Event],
    /// Ids in the dead-letter queue at the end.
    pub(super) dead_lettered: &'a HashSet<String>,
    /// Counts by key, per effect.
    pub(super) counts: &'a [HashMap<String, i64>],
}

/// The failures of one scenario, at most one per invariant, message and effect.
pub(super) fn check(
    scenario: Scenario,
    effects: &[EffectInfo],
    sent: &[Sent],
    seen: &Observed<'_>,
) -> Vec<Failure> {
    let mut completed: HashSet<&str> = HashSet::new();
    let mut commits: HashMap<&str, i64> = HashMap::new();
    for e in seen.events {
        match e {
            Event::Completed { id, .. } => {
                completed.insert(id);
            }
            // A COMMIT the server got counts, though the processor never heard it succeed.
            Event::Committed { id, .. } | Event::CommitUnknown { id, reached_server: true, .. } => {
                *commits.entry(id).or_default() += 1;
            }
            _ => {}
        }
    }
    let mut out = Vec::new();
    let mut push =
        |invariant, id: &str, effect: Option<&str>, key: Option<&str>, detail: String| {
            let f = Failure {
                invariant,
                scenario,
                message_id: id.to_owned(),
                effect: effect.map(str::to_owned),
                key: key.map(str::to_owned),
                detail,
            };
            if !out.iter().any(|o: &Failure| {
                o.invariant == f.invariant && o.message_id == f.message_id && o.effect == f.effect
            }) {
                out.push(f);
            }
        };

    for e in seen.events {
        if let Event::CompletedWithoutEffect { id, effect, key, .. } = e {
            push(
                Invariant::LostMessage,
                id,
                Some(effect),
                Some(key),
                "completed while its effect was not there (completed before its work committed?)"
                    .to_owned(),
            );
        }
    }

    for m in sent {
        let done = completed.contains(m.id.as_str());
        let dead = seen.dead_lettered.contains(&m.id);
        match (m.poison, done, dead) {
            (true, true, _) => push(
                Invariant::PoisonNotDeadLettered,
                &m.id,
                None,
                None,
                "a poison message was completed".to_owned(),
            ),
            (true, false, false) => push(
                Invariant::PoisonNotDeadLettered,
                &m.id,
                None,
                None,
                "a poison message was neither completed nor dead-lettered".to_owned(),
            ),
            (false, false, true) => push(
                Invariant::LostMessage,
                &m.id,
                None,
                None,
                "dead-lettered although it is no poison: its work never completed".to_owned(),
            ),
            (false, false, false) => push(
                Invariant::LostMessage,
                &m.id,
                None,
                None,
                "neither completed nor dead-lettered (deferred, or left on the queue)".to_owned(),
            ),
            _ => {}
        }
    }

    for (i, effect) in effects.iter().enumerate() {
        // The messages of each key, in a stable order.
        let mut by_key: BTreeMap<&str, Vec<&Sent>> = BTreeMap::new();
        for m in sent {
            if let Some(Some(k)) = m.keys.get(i) {
                by_key.entry(k).or_default().push(m);
            }
        }
        for (key, messages) in by_key {
            let count = seen.counts.get(i).and_then(|c| c.get(key)).copied().unwrap_or(0);
            let first = messages[0].id.as_str();
            let live: Vec<&&Sent> = messages
                .iter()
                .filter(|m| !m.poison && completed.contains(m.id.as_str()))
                .collect();
            let committed: i64 =
                messages.iter().map(|m| commits.get(m.id.as_str()).copied().unwrap_or(0)).sum();
            let name = Some(effect.name.as_str());
            if count == 0 {
                if let Some(m) = live.first() {
                    push(
                        Invariant::LostMessage,
                        &m.id,
                        name,
                        Some(key),
                        "the message was completed but its effect is missing".to_owned(),
                    );
                }
                continue;
            }
            if live.is_empty() {
                push(
                    Invariant::EffectOfRolledBackWork,
                    first,
                    name,
                    Some(key),
                    format!("{count} effect(s), but no message of this key was completed"),
                );
            } else if count > 1 && effect.in_database && count > committed {
                push(
                    Invariant::EffectOfRolledBackWork,
                    first,
                    name,
                    Some(key),
                    format!(
                        "{count} rows from {committed} committed attempt(s): work outside the \
                         message's transaction survived its rollback"
                    ),
                );
            } else if count > 1 {
                push(
                    Invariant::DoubleEffect,
                    first,
                    name,
                    Some(key),
                    format!("{count} effects where there must be one"),
                );
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sent(id: &str, key: &str) -> Sent {
        Sent { id: id.to_owned(), poison: false, keys: vec![Some(key.to_owned())] }
    }

    fn run(events: &[Event], counts: &[(&str, i64)], in_database: bool) -> Vec<Invariant> {
        let effects = [EffectInfo { name: "rows".to_owned(), in_database }];
        let counts = [counts.iter().map(|(k, n)| ((*k).to_owned(), *n)).collect()];
        let dead = HashSet::new();
        let seen = Observed { events, dead_lettered: &dead, counts: &counts };
        check(Scenario::LockLoss, &effects, &[sent("m1", "1")], &seen)
            .into_iter()
            .map(|f| f.invariant)
            .collect()
    }

    fn committed_and_completed() -> Vec<Event> {
        vec![Event::Committed { p: 0, id: "m1".into() }, Event::Completed { p: 0, id: "m1".into() }]
    }

    #[test]
    fn one_effect_of_a_completed_message_passes() {
        assert_eq!(run(&committed_and_completed(), &[("1", 1)], true), []);
    }

    #[test]
    fn each_broken_invariant_is_named() {
        let done = committed_and_completed();
        assert_eq!(run(&done, &[], true), [Invariant::LostMessage]);
        assert_eq!(run(&done, &[("1", 2)], true), [Invariant::EffectOfRolledBackWork]);
        assert_eq!(run(&done, &[("1", 2)], false), [Invariant::DoubleEffect]);
        let mut twice = done.clone();
        twice.push(Event::Committed { p: 1, id: "m1".into() });
        assert_eq!(run(&twice, &[("1", 2)], true), [Invariant::DoubleEffect]);
        let rolled_back = [Event::DeadLettered { p: 0, id: "m1".into(), reason: "x".into() }];
        let got = run(&rolled_back, &[("1", 1)], true);
        assert!(got.contains(&Invariant::EffectOfRolledBackWork), "{got:?}");
    }

    #[test]
    fn a_commit_the_server_got_counts_though_the_processor_never_heard_it() {
        let cut = |reached_server| Event::CommitUnknown {
            p: 0,
            id: "m1".into(),
            reached_server,
            error: "connection cut".into(),
        };
        let mut events = committed_and_completed();
        events.insert(0, cut(true));
        assert_eq!(run(&events, &[("1", 2)], true), [Invariant::DoubleEffect]);
        events[0] = cut(false);
        assert_eq!(run(&events, &[("1", 2)], true), [Invariant::EffectOfRolledBackWork]);
        assert_eq!(run(&events, &[("1", 1)], true), []);
    }

    #[test]
    fn a_completed_poison_message_is_named() {
        let effects: [EffectInfo; 0] = [];
        let events = [Event::Completed { p: 0, id: "bad".into() }];
        let dead = HashSet::new();
        let seen = Observed { events: &events, dead_lettered: &dead, counts: &[] };
        let poison = Sent { id: "bad".into(), poison: true, keys: vec![] };
        let got = check(Scenario::ConcurrentCopies, &effects, &[poison], &seen);
        assert_eq!(got[0].invariant, Invariant::PoisonNotDeadLettered);
    }
}
