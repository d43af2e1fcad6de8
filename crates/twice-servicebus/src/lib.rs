//! The twice broker served over AMQP 1.0 to the Azure Service Bus SDKs.
