package brokermetrics

import (
	"sync"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
)

// Pairs keeps the measurement option of each pair of values of two attributes, so that
// a measurement on a hot path (every send, every request to a target) neither builds
// nor hashes an attribute set. The values must come from small, fixed sets (target
// names, outcome classes), as every metric attribute's must.
type Pairs struct {
	first, second string
	options       sync.Map // [2]string → metric.MeasurementOption
}

// NewPairs returns the options of the attributes named first and second.
func NewPairs(first, second string) *Pairs {
	return &Pairs{first: first, second: second}
}

// Of returns the option that records the attributes with the values v1 and v2.
func (p *Pairs) Of(v1, v2 string) metric.MeasurementOption {
	k := [2]string{v1, v2}
	if o, ok := p.options.Load(k); ok {
		return o.(metric.MeasurementOption)
	}
	o, _ := p.options.LoadOrStore(k, metric.WithAttributeSet(attribute.NewSet(
		attribute.String(p.first, v1), attribute.String(p.second, v2))))
	return o.(metric.MeasurementOption)
}
