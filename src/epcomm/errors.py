"""Exceptions raised by epcomm. Every message starts with the function that raised it."""


class EpcommError(RuntimeError):
    """Base class of epcomm's own errors."""


class EpcommTimeoutError(EpcommError, TimeoutError):
    """A wait (host or device) exceeded its timeout. The message names the rank, the peer and what was awaited."""


class TransportUnavailableError(EpcommError):
    """A transport was forced that this hardware cannot run; the message names the capability and the ranks."""


class BufferTooSmallError(EpcommError):
    """The symmetric buffer cannot hold what one call needs; the message says which size to ask for."""


class EpcommDeviceError(EpcommError):
    """A call failed on the device (a wait timed out, rows did not fit, invalid input in a call without host
    synchronisation). Sticky: every later call of the Buffer raises it until the state is reset (see
    ``Buffer``'s "Errors" section). The message names the rank, the peer and what was awaited."""
