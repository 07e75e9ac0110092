package flightdeck.spark;

import org.apache.arrow.flight.ErrorFlightMetadata;
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

  /**
   * The error {@code e} from the server at {@code location}, with the gRPC
   * code the server answered with: Flight's own codes fold several into one
   * ({@code FAILED_PRECONDITION}, which says to change something first,
   * arrives as {@code INVALID_ARGUMENT}), so the code the server sent in its
   * trailer is taken where there is one. An error of the transport (no
   * trailer) says which server could not be reached and what to check.
   */
  static FlightDeckException of(FlightRuntimeException e, String location) {
    String message = e.getMessage() == null ? "" : e.getMessage();
    String sent = sentCode(e);
    String code = sent != null ? sent : e.status().code().name();
    boolean tls = tls(e);
    if (sent == null && (code.equals("UNAVAILABLE") || tls)) {
      // The transport's, not a server's: say which server and what to check.
      Throwable root = e;
      while (root.getCause() != null && root.getCause() != root) {
        root = root.getCause();
      }
      String why = root == e || root.getMessage() == null ? message : root.getMessage();
      message = tls
          ? "the TLS handshake with the flightdeck server at " + location + " failed (" + why
              + "): a server started with --tls-cert takes grpc+tls:// and a client that "
              + "trusts its certificate authority (FLIGHTDECK_TLS_ROOT_CERTS naming its PEM "
              + "file on the driver and every executor, or the JVM's trust store); one "
              + "started without it takes grpc://"
          : "cannot reach the flightdeck server at " + location + " (" + why + "): start "
              + "it (flightdeck serve) or point option uri at a running one (or uris at "
              + "running ones; with uri local, each executor's FLIGHTDECK_URI, else "
              + "grpc://127.0.0.1:50051)";
    } else if (code.equals("UNAVAILABLE") && !message.contains(location)) {
      message = message + " (server " + location + ")";
    }
    FlightDeckException out = new FlightDeckException(code, message);
    out.initCause(e);
    return out;
  }

  /**
   * Whether {@code e} came of TLS on one side only: a certificate the client
   * does not trust, a plain server reached over TLS, or a TLS server (whose
   * first bytes are a TLS record, not HTTP/2's SETTINGS) reached without.
   */
  private static boolean tls(Throwable e) {
    for (Throwable c = e; c != null; c = c.getCause() == c ? null : c.getCause()) {
      String said = c.getMessage() == null ? "" : c.getMessage();
      if (c instanceof javax.net.ssl.SSLException
          || c instanceof java.security.GeneralSecurityException
          || c.getClass().getSimpleName().startsWith("NotSsl")
          || said.contains("was not SETTINGS. Hex dump for first 5 bytes: 1")) {
        return true;
      }
    }
    return false;
  }

  /** The trailer in which a flightdeck server sends its error's gRPC code as a number. */
  static final String CODE_TRAILER = "flightdeck-grpc-code";

  /** The code a flightdeck server sent in its trailer; null where there is none. */
  private static String sentCode(FlightRuntimeException e) {
    ErrorFlightMetadata trailers = e.status().metadata();
    // get() throws rather than answer null for a key that is not there (an
    // error of the transport, such as a server not running, has none).
    if (trailers == null || !trailers.containsKey(CODE_TRAILER)) {
      return null;
    }
    try {
      return io.grpc.Status.fromCodeValue(Integer.parseInt(trailers.get(CODE_TRAILER).trim()))
          .getCode()
          .name();
    } catch (NumberFormatException notANumber) {
      return null; // not ours: Flight's code
    }
  }
}
