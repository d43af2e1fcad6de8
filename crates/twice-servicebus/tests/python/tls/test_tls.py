"""The SDK's credential constructors, which always use TLS, against `twice serve --tls-cert`,
and its administration client, which speaks only https, against the server's HTTP port.

The server's certificate is signed by a CA made by the test; the SDK trusts it through its
`connection_verify` option, and reaches the server's port through `custom_endpoint_address`
(the constructors otherwise dial 5671).
"""

import base64
import hashlib
import hmac
import os
import time
import urllib.parse
import uuid

from azure.core.credentials import AzureNamedKeyCredential, AzureSasCredential
from azure.servicebus import ServiceBusClient, ServiceBusMessage, TransportType
from azure.servicebus.management import ServiceBusAdministrationClient

KEY_NAME = "RootManageSharedAccessKey"
KEY = "SAS_KEY_VALUE"


def client(credential):
    return ServiceBusClient(
        "localhost",
        credential,
        custom_endpoint_address=f"sb://localhost:{os.environ['SB_PORT']}",
        transport_type=TransportType.Amqp,
        connection_verify=os.environ["SB_TLS_CA"],
        retry_total=0,
    )


def round_trip(c, queue, body):
    with c.get_queue_sender(queue) as sender:
        sender.send_messages(ServiceBusMessage(body))
    with c.get_queue_receiver(queue, max_wait_time=5) as receiver:
        got = receiver.receive_messages(max_message_count=1, max_wait_time=5)
        assert [str(m) for m in got] == [body]
        receiver.complete_message(got[0])


def test_named_key_credential_over_tls():
    with client(AzureNamedKeyCredential(KEY_NAME, KEY)) as c:
        round_trip(c, "q15", "named key over tls")


def test_sas_credential_over_tls():
    resource = "sb://localhost/"
    expiry = int(time.time()) + 600
    encoded = urllib.parse.quote_plus(resource)
    signed = hmac.new(KEY.encode(), f"{encoded}\n{expiry}".encode(), hashlib.sha256).digest()
    signature = urllib.parse.quote_plus(base64.b64encode(signed).decode())
    token = f"SharedAccessSignature sr={encoded}&sig={signature}&se={expiry}&skn={KEY_NAME}"
    with client(AzureSasCredential(token)) as c:
        round_trip(c, "q15", "sas credential over tls")


def test_a_wrong_ca_is_refused():
    # The system's roots do not include the test CA: the handshake fails, nothing is sent.
    c = ServiceBusClient(
        "localhost",
        AzureNamedKeyCredential(KEY_NAME, KEY),
        custom_endpoint_address=f"sb://localhost:{os.environ['SB_PORT']}",
        transport_type=TransportType.Amqp,
        retry_total=0,
    )
    try:
        with c.get_queue_sender("q15") as sender:
            sender.send_messages(ServiceBusMessage("never"))
        raise AssertionError("a server whose CA is not trusted was accepted")
    except AssertionError:
        raise
    except Exception as e:  # the SDK's connection error, caused by the certificate
        assert "CERTIFICATE_VERIFY_FAILED" in repr(e) or "certificate" in repr(e).lower(), repr(e)
    finally:
        c.close()


def test_administration_client_over_https_unmodified():
    # No transport of the test's own: the client's https requests reach the HTTP port as they
    # are, and the certificate is checked against the test CA.
    http_port = os.environ["SB_HTTP"].rsplit(":", 1)[1]
    conn_str = (
        f"Endpoint=sb://localhost:{http_port};SharedAccessKeyName={KEY_NAME};SharedAccessKey={KEY}"
    )
    with ServiceBusAdministrationClient.from_connection_string(
        conn_str,
        connection_verify=os.environ["SB_TLS_CA"],
        retry_total=0,
    ) as admin:
        name = f"tls-admin-{uuid.uuid4().hex[:8]}"
        admin.create_queue(name, max_delivery_count=7)
        assert admin.get_queue(name).max_delivery_count == 7
        with client(AzureNamedKeyCredential(KEY_NAME, KEY)) as c:
            with c.get_queue_sender(name) as sender:
                sender.send_messages(ServiceBusMessage("created over https"))
        assert admin.get_queue_runtime_properties(name).active_message_count == 1
        admin.delete_queue(name)
        assert name not in [q.name for q in admin.list_queues()]
