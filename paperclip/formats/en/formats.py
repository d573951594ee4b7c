"""Date formats of the console: absolute times always name their zone (TIME_ZONE, UTC)."""

DATETIME_FORMAT = "Y-m-d H:i:s T"
SHORT_DATETIME_FORMAT = "Y-m-d H:i T"
DATE_FORMAT = "Y-m-d"
SHORT_DATE_FORMAT = "Y-m-d"
TIME_FORMAT = "H:i:s"
