package flightdeck.spark;

import org.apache.arrow.flight.FlightRuntimeException;

/**
 * An error a flightdeck server answered (or reaching it failed), with the
 * gRPC code's name ({@code NOT_FOUND}, {@code FAILED_PRECONDITION}, ...)
 * and the server's message, which says what to do.
 */
public final class FlightDeckException extends RuntimeException {
  private static final long serialVersionUID = 1L;

  /** The gRPC status code's name. */
  public final String code;

  FlightDeckException(String code, String message) {
    super(code + ": " + message);
    this.code = code;
  }

  static FlightDeckException of(FlightRuntimeException e, String location) {
    String message = e.getMessage() == null ? "" : e.getMessage();
    String code = e.status().code().name();
    if (code.equals("UNAVAILABLE") && !message.contains(location)) {
      message = message + " (server " + location + ")";
    }
    FlightDeckException out = new FlightDeckException(code, message);
    out.initCause(e);
    return out;
  }
}
