package gcpace

// SetFrom is Default with the memory limit from limit.
var SetFrom = set
