// The administration API with the JavaScript SDK's ServiceBusAdministrationClient, configured
// from the emulator connection string pointed at the HTTP port, and nothing else: the SDK's
// administration client always speaks https (it ignores UseDevelopmentEmulator), and the port
// speaks https beside http with the server's development certificate, whose CA the environment
// trusts (NODE_EXTRA_CA_CERTS, as `twice serve` prints).
import { test, after } from "node:test";
import assert from "node:assert/strict";
import { randomUUID } from "node:crypto";
import { ServiceBusAdministrationClient, ServiceBusClient } from "@azure/service-bus";

const httpPort = process.env.SB_HTTP.split(":").pop();
const connStr = (key) =>
  `Endpoint=sb://localhost:${httpPort};SharedAccessKeyName=RootManageSharedAccessKey;` +
  `SharedAccessKey=${key};UseDevelopmentEmulator=true;`;
function adminClient(key) {
  return new ServiceBusAdministrationClient(connStr(key), { retryOptions: { maxRetries: 0 } });
}
const admin = adminClient("SAS_KEY_VALUE");
const client = new ServiceBusClient(process.env.SB_CONNECTION_STRING, {
  retryOptions: { maxRetries: 0, timeoutInMs: 20000 },
});

after(async () => {
  await client.close();
});

const name = (prefix) => `${prefix}-${randomUUID().slice(0, 8)}`;

async function all(iter) {
  const out = [];
  for await (const x of iter) out.push(x);
  return out;
}

test("a queue: create, get, update, list, runtime properties, delete", async () => {
  const q = name("jsq");
  const created = await admin.createQueue(q, { maxDeliveryCount: 7, lockDuration: "PT30S" });
  assert.equal(created.name, q);
  assert.equal(created.maxDeliveryCount, 7);
  assert.equal(created.lockDuration, "PT30S");
  assert.equal(created.maxSizeInMegabytes, 1024);
  await assert.rejects(admin.createQueue(q), (e) => e.statusCode === 409);

  const got = await admin.getQueue(q);
  got.maxDeliveryCount = 3;
  await admin.updateQueue(got);
  assert.equal((await admin.getQueue(q)).maxDeliveryCount, 3);
  assert.ok((await all(admin.listQueues())).some((x) => x.name === q));
  assert.ok(await admin.queueExists(q));

  const sender = client.createSender(q);
  await sender.sendMessages([{ body: "a" }, { body: "b" }]);
  await sender.close();
  const rt = await admin.getQueueRuntimeProperties(q);
  assert.equal(rt.activeMessageCount, 2);
  assert.equal(rt.deadLetterMessageCount, 0);
  assert.equal(rt.totalMessageCount, 2);

  await admin.deleteQueue(q);
  assert.equal(await admin.queueExists(q), false);
  await assert.rejects(admin.getQueue(q), (e) => e.statusCode === 404);
});

test("a topic, a subscription and a SQL rule with an action", async () => {
  const t = name("jst");
  await admin.createTopic(t);
  const topic = await admin.getTopic(t);
  topic.defaultMessageTimeToLive = "PT2H";
  await admin.updateTopic(topic);
  assert.equal((await admin.getTopic(t)).defaultMessageTimeToLive, "PT2H");
  assert.ok((await all(admin.listTopics())).some((x) => x.name === t));

  const sub = await admin.createSubscription(t, "red", { maxDeliveryCount: 5 });
  assert.equal(sub.subscriptionName, "red");
  assert.equal(sub.topicName, t);
  const got = await admin.getSubscription(t, "red");
  got.maxDeliveryCount = 4;
  await admin.updateSubscription(got);
  assert.equal((await admin.getSubscription(t, "red")).maxDeliveryCount, 4);
  assert.deepEqual((await all(admin.listSubscriptions(t))).map((s) => s.subscriptionName), ["red"]);

  await admin.createRule(t, "red", "reds", { sqlExpression: "color = 'red'" }, { sqlExpression: "SET marked = 'yes'" });
  await admin.deleteRule(t, "red", "$Default");
  const rule = await admin.getRule(t, "red", "reds");
  assert.equal(rule.name, "reds");
  assert.equal(rule.filter.sqlExpression, "color = 'red'");
  assert.equal(rule.action.sqlExpression, "SET marked = 'yes'");
  rule.filter = { sqlExpression: "color = 'red' OR color = 'crimson'" };
  await admin.updateRule(t, "red", rule);
  assert.equal((await admin.getRule(t, "red", "reds")).filter.sqlExpression, "color = 'red' OR color = 'crimson'");
  assert.deepEqual((await all(admin.listRules(t, "red"))).map((r) => r.name), ["reds"]);

  const sender = client.createSender(t);
  await sender.sendMessages([
    { body: "r", applicationProperties: { color: "red" } },
    { body: "b", applicationProperties: { color: "blue" } },
  ]);
  await sender.close();
  const srt = await admin.getSubscriptionRuntimeProperties(t, "red");
  assert.equal(srt.activeMessageCount, 1);
  const receiver = client.createReceiver(t, "red");
  const [m] = await receiver.receiveMessages(1, { maxWaitTimeInMs: 5000 });
  assert.equal(m.body, "r");
  assert.equal(m.applicationProperties.marked, "yes");
  await receiver.completeMessage(m);
  await receiver.close();

  await admin.deleteSubscription(t, "red");
  await assert.rejects(admin.getSubscription(t, "red"), (e) => e.statusCode === 404);
  await admin.deleteTopic(t);
  assert.equal(await admin.topicExists(t), false);
});

test("a wrong key is unauthorized", async () => {
  const bad = adminClient("WRONG");
  await assert.rejects(bad.getQueue("q1"), (e) => e.statusCode === 401);
  await assert.rejects(bad.createQueue(name("nope")), (e) => e.statusCode === 401);
});
