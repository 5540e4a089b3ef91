package server

import (
	"fmt"
	"strings"

	"github.com/google/uuid"
)

// operationName formats the resource name of an operation.
func operationName(tenant string, id uuid.UUID) string {
	return fmt.Sprintf("tenants/%s/operations/%s", tenant, id)
}

// parseOperationName splits a resource name that has passed request validation (its
// shape is checked by the proto's pattern); field names the request field for errors.
func parseOperationName(field, name string) (tenant string, id uuid.UUID, err error) {
	parts := strings.Split(name, "/")
	if len(parts) != 4 || parts[0] != "tenants" || parts[2] != "operations" {
		return "", uuid.Nil, invalidArgument(violation(field, "must be tenants/{tenant}/operations/{operation}", "NAME_FORMAT"))
	}
	id, err = uuid.Parse(parts[3])
	if err != nil {
		return "", uuid.Nil, invalidArgument(violation(field, "operation id must be a UUID", "NAME_FORMAT"))
	}
	return parts[1], id, nil
}
