package brokermetrics

import "time"

// SetNow makes l read the time from now.
func (l *Ledger) SetNow(now func() time.Time) { l.now = now }
