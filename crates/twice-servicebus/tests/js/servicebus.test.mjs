// The JavaScript SDK against twice: the main paths (send and receive, every settlement,
// sessions, peek, schedule, the dead-letter queue, rules).
import { test, after } from "node:test";
import assert from "node:assert/strict";
import { ServiceBusClient } from "@azure/service-bus";
import Long from "long";

const client = new ServiceBusClient(process.env.SB_CONNECTION_STRING, {
  retryOptions: { maxRetries: 0, timeoutInMs: 20000 },
});

after(async () => {
  await client.close();
});

async function receiveAll(receiver, n, waitMs = 5000) {
  const got = [];
  for (let i = 0; i < 10 && got.length < n; i++) {
    got.push(...(await receiver.receiveMessages(n - got.length, { maxWaitTimeInMs: waitMs })));
  }
  return got;
}

test("send, receive and complete keep the message's properties", async () => {
  const sender = client.createSender("q18");
  await sender.sendMessages({
    body: "js-1",
    messageId: "jm1",
    subject: "subj",
    correlationId: "corr",
    contentType: "text/plain",
    applicationProperties: { k: "v", n: 7 },
  });
  await sender.close();
  const receiver = client.createReceiver("q18");
  const [m] = await receiveAll(receiver, 1);
  assert.equal(m.body, "js-1");
  assert.equal(m.messageId, "jm1");
  assert.equal(m.subject, "subj");
  assert.equal(m.correlationId, "corr");
  assert.equal(m.contentType, "text/plain");
  assert.deepEqual(m.applicationProperties, { k: "v", n: 7 });
  assert.equal(m.deliveryCount, 0);
  assert.ok(m.sequenceNumber.toNumber() >= 1);
  assert.ok(m.lockToken);
  assert.ok(m.lockedUntilUtc instanceof Date);
  await receiver.completeMessage(m);
  assert.deepEqual(await receiver.receiveMessages(1, { maxWaitTimeInMs: 500 }), []);
  await receiver.close();
});

test("batch send, then abandon, defer and dead-letter over the link", async () => {
  const sender = client.createSender("q18");
  const batch = await sender.createMessageBatch();
  assert.ok(batch.tryAddMessage({ body: "b1" }));
  assert.ok(batch.tryAddMessage({ body: "b2" }));
  assert.ok(batch.tryAddMessage({ body: "b3" }));
  await sender.sendMessages(batch);
  await sender.close();
  const receiver = client.createReceiver("q18");
  const msgs = await receiveAll(receiver, 3);
  assert.deepEqual(msgs.map((m) => m.body).sort(), ["b1", "b2", "b3"]);
  const byBody = Object.fromEntries(msgs.map((m) => [m.body, m]));
  // The broker assigns a message id when the sender sets none.
  assert.ok(byBody.b1.messageId);
  await receiver.abandonMessage(byBody.b1, { abandonProp: "x" });
  await receiver.deferMessage(byBody.b2);
  await receiver.deadLetterMessage(byBody.b3, { deadLetterReason: "r", deadLetterErrorDescription: "d" });
  const [again] = await receiveAll(receiver, 1);
  assert.equal(again.body, "b1");
  assert.equal(again.deliveryCount, 1);
  assert.equal(again.applicationProperties.abandonProp, "x");
  await receiver.completeMessage(again);
  const [deferred] = await receiver.receiveDeferredMessages([byBody.b2.sequenceNumber]);
  assert.equal(deferred.body, "b2");
  await receiver.completeMessage(deferred);
  await receiver.close();
  const dlq = client.createReceiver("q18", { subQueueType: "deadLetter" });
  const [dead] = await receiveAll(dlq, 1);
  assert.equal(dead.body, "b3");
  assert.equal(dead.deadLetterReason, "r");
  assert.equal(dead.deadLetterErrorDescription, "d");
  await dlq.completeMessage(dead);
  await dlq.close();
});

test("renew lock, peek, and receive-and-delete", async () => {
  const sender = client.createSender("q19");
  await sender.sendMessages([{ body: "p1" }, { body: "p2" }]);
  await sender.close();
  const peeker = client.createReceiver("q19");
  const peeked = await peeker.peekMessages(5, { fromSequenceNumber: Long.fromNumber(1) });
  assert.deepEqual(peeked.map((m) => m.body), ["p1", "p2"]);
  const [locked] = await receiveAll(peeker, 1);
  const until = await peeker.renewMessageLock(locked);
  assert.ok(until instanceof Date);
  await peeker.abandonMessage(locked);
  await peeker.close();
  const rd = client.createReceiver("q19", { receiveMode: "receiveAndDelete" });
  const got = await receiveAll(rd, 2);
  assert.deepEqual(got.map((m) => m.body).sort(), ["p1", "p2"]);
  await rd.close();
  const empty = client.createReceiver("q19");
  assert.deepEqual(await empty.peekMessages(5), []);
  await empty.close();
});

test("schedule and cancel", async () => {
  const sender = client.createSender("q20");
  const at = new Date(Date.now() + 10 * 60 * 1000);
  const seqs = await sender.scheduleMessages([{ body: "sch" }], at);
  assert.equal(seqs.length, 1);
  const receiver = client.createReceiver("q20");
  const peeked = await receiver.peekMessages(5);
  assert.equal(peeked.length, 1);
  assert.equal(peeked[0].state, "scheduled");
  await sender.cancelScheduledMessages(seqs);
  assert.deepEqual(await receiver.peekMessages(5), []);
  await receiver.close();
  await sender.close();
});

test("sessions: next available, state, renew, named, and refusal of a held one", async () => {
  const sender = client.createSender("sessq4");
  await sender.sendMessages([
    { body: "a", sessionId: "s1" },
    { body: "b", sessionId: "s1" },
  ]);
  await sender.close();
  const session = await client.acceptNextSession("sessq4", { maxAutoLockRenewalDurationInMs: 0 });
  assert.equal(session.sessionId, "s1");
  assert.ok(session.sessionLockedUntilUtc instanceof Date);
  const got = await receiveAll(session, 2);
  assert.deepEqual(got.map((m) => m.body), ["a", "b"]);
  for (const m of got) await session.completeMessage(m);
  await session.setSessionState("st");
  assert.equal(await session.getSessionState(), "st");
  const renewed = await session.renewSessionLock();
  assert.ok(renewed instanceof Date);
  await assert.rejects(
    client.acceptSession("sessq4", "s1", { maxAutoLockRenewalDurationInMs: 0 }),
    (e) => e.code === "SessionCannotBeLocked",
  );
  await session.close();
  const named = await client.acceptSession("sessq4", "s1", { maxAutoLockRenewalDurationInMs: 0 });
  assert.equal(named.sessionId, "s1");
  await named.close();
});

test("accept next session times out when no session has messages", async () => {
  // The SDK sends its operation timeout as `com.microsoft:timeout`; a short one keeps this quick.
  const quick = new ServiceBusClient(process.env.SB_CONNECTION_STRING, {
    retryOptions: { maxRetries: 0, timeoutInMs: 3000 },
  });
  await assert.rejects(
    quick.acceptNextSession("sessq5", { maxAutoLockRenewalDurationInMs: 0 }),
    (e) => e.code === "ServiceTimeout",
  );
  await quick.close();
});

test("closing a session with an unsettled message does not count a delivery", async () => {
  const sender = client.createSender("sessq7");
  await sender.sendMessages({ body: "kept", sessionId: "c1" });
  await sender.close();
  const first = await client.acceptSession("sessq7", "c1", { maxAutoLockRenewalDurationInMs: 0 });
  const [m] = await first.receiveMessages(1, { maxWaitTimeInMs: 5000 });
  assert.equal(m.deliveryCount, 0);
  await first.close();
  const again = await client.acceptSession("sessq7", "c1", { maxAutoLockRenewalDurationInMs: 0 });
  const [m2] = await again.receiveMessages(1, { maxWaitTimeInMs: 5000 });
  assert.equal(m2.body, "kept");
  assert.equal(m2.deliveryCount, 0);
  await again.completeMessage(m2);
  await again.close();
});

test("topic rules route messages to subscriptions", async () => {
  const rules = client.createRuleManager("topic2", "filtered");
  await rules.createRule("only-red", { correlationId: "red" });
  await rules.deleteRule("$Default");
  const names = [];
  for await (const r of rules.listRules()) names.push(r.name);
  assert.deepEqual(names, ["only-red"]);
  const sender = client.createSender("topic2");
  await sender.sendMessages([
    { body: "r", correlationId: "red" },
    { body: "g", correlationId: "green" },
  ]);
  await sender.close();
  const all = client.createReceiver("topic2", "all");
  const allGot = await receiveAll(all, 2);
  assert.deepEqual(allGot.map((m) => m.body).sort(), ["g", "r"]);
  for (const m of allGot) await all.completeMessage(m);
  await all.close();
  const filtered = client.createReceiver("topic2", "filtered");
  const got = await receiveAll(filtered, 1);
  assert.deepEqual(got.map((m) => m.body), ["r"]);
  await filtered.completeMessage(got[0]);
  assert.deepEqual(await filtered.receiveMessages(1, { maxWaitTimeInMs: 500 }), []);
  await filtered.close();
});

test("SQL rules filter, their actions change a copy, and a taken name is refused", async () => {
  const rules = client.createRuleManager("topic3", "sql");
  await rules.createRule("big-red", { sqlExpression: "color = 'red' AND quantity > 10" });
  await rules.createRule(
    "rush",
    { sqlExpression: "sys.Label LIKE 'rush%'" },
    { sqlExpression: "SET priority = 'high'; REMOVE color" },
  );
  await rules.deleteRule("$Default");
  await assert.rejects(
    rules.createRule("BIG-RED", { sqlExpression: "1=1" }),
    (e) => e.code === "MessagingEntityAlreadyExists",
  );
  await assert.rejects(rules.createRule("bad", { sqlExpression: "color = = 1" }), (e) =>
    /position 8/.test(e.message),
  );
  const listed = [];
  for await (const r of rules.listRules()) listed.push(r);
  assert.deepEqual(
    listed.map((r) => [r.name, r.filter.sqlExpression, r.action && r.action.sqlExpression]),
    [
      ["big-red", "color = 'red' AND quantity > 10", undefined],
      ["rush", "sys.Label LIKE 'rush%'", "SET priority = 'high'; REMOVE color"],
    ],
  );
  const sender = client.createSender("topic3");
  await sender.sendMessages([
    { body: "a", applicationProperties: { color: "red", quantity: 11 } },
    { body: "b", applicationProperties: { color: "red", quantity: 3 } },
    { body: "c", subject: "rush-1", applicationProperties: { color: "blue" } },
  ]);
  await sender.close();
  const receiver = client.createReceiver("topic3", "sql");
  const got = await receiveAll(receiver, 2);
  assert.deepEqual(got.map((m) => m.body), ["a", "c"]);
  assert.equal(got[0].applicationProperties.RuleName, undefined);
  assert.equal(got[1].applicationProperties.RuleName, "rush");
  assert.equal(got[1].applicationProperties.priority, "high");
  assert.equal(got[1].applicationProperties.color, undefined);
  for (const m of got) await receiver.completeMessage(m);
  assert.deepEqual(await receiver.receiveMessages(1, { maxWaitTimeInMs: 500 }), []);
  await receiver.close();
});

test("a full queue refuses sends with QuotaExceeded and takes them again once drained", async () => {
  const sender = client.createSender("quotaq");
  const big = "x".repeat(200 * 1024);
  let sent = 0;
  await assert.rejects(
    (async () => {
      for (; sent < 10; sent++) await sender.sendMessages({ body: big });
    })(),
    (e) => e.code === "QuotaExceeded",
  );
  assert.ok(sent >= 4 && sent <= 5, `sent ${sent} before the 1 MB quota`);
  const receiver = client.createReceiver("quotaq", { receiveMode: "receiveAndDelete" });
  const got = await receiveAll(receiver, sent);
  assert.equal(got.length, sent);
  await sender.sendMessages({ body: big });
  await sender.close();
  assert.equal((await receiveAll(receiver, 1)).length, 1);
  await receiver.close();
});

test("unknown entity is MessagingEntityNotFound", async () => {
  const sender = client.createSender("no-such-queue");
  await assert.rejects(sender.sendMessages({ body: "x" }), (e) => e.code === "MessagingEntityNotFound");
  await sender.close();
});
