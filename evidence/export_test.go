package evidence

// RejectionReasons are the webhook listener's reasons, for the external tests.
var RejectionReasons = rejectionReasons
