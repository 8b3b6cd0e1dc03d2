"""An entry point that loads but implements no hook."""

VERSION = "1.0"
