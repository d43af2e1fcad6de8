// The SDK's credential constructors, which always use TLS, against `twice serve --tls-cert`:
// the server's CA is trusted through NODE_EXTRA_CA_CERTS, its port reached through
// `customEndpointAddress` (the constructors otherwise dial 5671). And its administration
// client, which speaks only https, against the server's HTTP port, with nothing added.
import { test } from "node:test";
import assert from "node:assert/strict";
import { createHmac } from "node:crypto";
import { randomUUID } from "node:crypto";
import { ServiceBusAdministrationClient, ServiceBusClient } from "@azure/service-bus";
import { AzureNamedKeyCredential, AzureSASCredential } from "@azure/core-auth";

const KEY_NAME = "RootManageSharedAccessKey";
const KEY = "SAS_KEY_VALUE";

function client(credential) {
  return new ServiceBusClient("localhost", credential, {
    customEndpointAddress: `sb://localhost:${process.env.SB_PORT}`,
    retryOptions: { maxRetries: 0, timeoutInMs: 20000 },
  });
}

async function roundTrip(c, queue, body) {
  const sender = c.createSender(queue);
  await sender.sendMessages({ body });
  await sender.close();
  const receiver = c.createReceiver(queue);
  const got = await receiver.receiveMessages(1, { maxWaitTimeInMs: 5000 });
  assert.deepEqual(got.map((m) => m.body), [body]);
  await receiver.completeMessage(got[0]);
  await receiver.close();
}

test("a named key credential over TLS", async () => {
  const c = client(new AzureNamedKeyCredential(KEY_NAME, KEY));
  await roundTrip(c, "q16", "named key over tls");
  await c.close();
});

test("a SAS credential over TLS", async () => {
  const resource = encodeURIComponent("sb://localhost/");
  const expiry = Math.floor(Date.now() / 1000) + 600;
  const sig = createHmac("sha256", KEY).update(`${resource}\n${expiry}`).digest("base64");
  const token = `SharedAccessSignature sr=${resource}&sig=${encodeURIComponent(sig)}&se=${expiry}&skn=${KEY_NAME}`;
  const c = client(new AzureSASCredential(token));
  await roundTrip(c, "q16", "sas credential over tls");
  await c.close();
});

test("the administration client over https, unmodified", async () => {
  const httpPort = process.env.SB_HTTP.split(":").pop();
  const admin = new ServiceBusAdministrationClient(
    `Endpoint=sb://localhost:${httpPort};SharedAccessKeyName=${KEY_NAME};SharedAccessKey=${KEY}`,
    { retryOptions: { maxRetries: 0 } },
  );
  const name = `tls-admin-${randomUUID().slice(0, 8)}`;
  await admin.createQueue(name, { maxDeliveryCount: 7 });
  assert.equal((await admin.getQueue(name)).maxDeliveryCount, 7);
  const c = client(new AzureNamedKeyCredential(KEY_NAME, KEY));
  const sender = c.createSender(name);
  await sender.sendMessages({ body: "created over https" });
  await sender.close();
  await c.close();
  assert.equal((await admin.getQueueRuntimeProperties(name)).activeMessageCount, 1);
  await admin.deleteQueue(name);
  assert.equal(await admin.queueExists(name), false);
});
