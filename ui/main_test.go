package ui_test

import (
	"testing"

	"github.com/opbroker/opbroker/storetest"
)

func TestMain(m *testing.M) { storetest.Main(m) }
