// Package brokermetrics holds the broker's metrics that alerts are written against
// (deploy/prometheus/alerts.yaml; docs/operations.md#metrics lists them all):
//
//   - Ledger: gauges of the open operations, from one ledger statement per interval
//     (store.Scope.OpenStats), cached, so that a scrape never queries the database;
//   - Events: what happens to UNKNOWN operations, counted when it happens by the
//     dispatcher and the reconciler (entered, by cause; resolved, by how and how long
//     after the first send);
//   - TimedConnector: how long each request to a target takes;
//   - Evidence: the events targets report, kept, decided and refused (package evidence).
//
// No metric is labelled by tenant or operation: their series are bounded by the targets
// in the contracts, the states and the outcome classes.
//
// Every replica that runs a Ledger reads the ledger itself, rather than one replica
// elected with an advisory lock. The statement reads only open operations, through the
// indexes of their states, once per interval: with a handful of replicas it costs a
// handful of statements every 15 seconds, next to the claims each dispatcher polls for
// every second. An elected reader would need a session-level lock held on a connection
// of its own, a hand-over when its replica dies or its connection breaks, and replicas
// that export nothing meanwhile; a reader per replica has none of that, and any replica
// Prometheus can scrape reports the whole ledger. Each replica reports the same values,
// so alerts and dashboards aggregate them with max, never sum.
package brokermetrics
