//! An embeddable, durable message broker with Azure Service Bus semantics.
