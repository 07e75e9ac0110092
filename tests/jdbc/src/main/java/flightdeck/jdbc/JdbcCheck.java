package flightdeck.jdbc;

import java.sql.Connection;
import java.sql.DatabaseMetaData;
import java.sql.DriverManager;
import java.sql.PreparedStatement;
import java.sql.ResultSet;
import java.sql.ResultSetMetaData;
import java.sql.SQLException;
import java.sql.Statement;

/**
 * Runs JDBC calls against a Flight SQL endpoint through Arrow's Flight SQL
 * JDBC driver and prints one JSON line per call, for the tests to check.
 *
 * <p>{@code java -cp 'target/classes:target/lib/*' flightdeck.jdbc.JdbcCheck URL CALL...},
 * each CALL a tab-separated list: {@code query SQL}, {@code prepared SQL
 * TYPE:VALUE...} (TYPE one of int, long, double, string, decimal, bool,
 * date ({@code yyyy-mm-dd}), time ({@code hh:mm:ss}), timestamp ({@code yyyy-mm-dd hh:mm:ss}, in the
 * JVM's time zone); executed once per
 * group of values, groups separated by a {@code |} of their own), {@code update SQL}
 * ({@code executeUpdate}), {@code prepared-update SQL TYPE:VALUE...} (a prepared
 * statement's {@code executeUpdate}, its values bound once), {@code tables},
 * {@code columns TABLE}, {@code primary-keys TABLE}, {@code imported-keys
 * TABLE}, {@code exported-keys TABLE} or {@code type-info}. A line is
 * {@code {"columns": [[name, type]...], "rows": [[value...]...]}},
 * {@code {"updated": COUNT}} or {@code {"error": "..."}}; values are printed as strings (null as null,
 * bytes in hex).
 */
public final class JdbcCheck {
    private JdbcCheck() {}

    /** Runs each call given after the URL, one JSON line each. */
    public static void main(String[] args) {
        int status = 0;
        try (Connection connection = DriverManager.getConnection(args[0])) {
            for (int i = 1; i < args.length; i++) {
                System.out.println(run(connection, args[i].split("\t", -1)));
            }
        } catch (SQLException e) {
            System.err.println("JdbcCheck: " + e);
            e.printStackTrace();
            status = 1;
        }
        // The driver's threads are not daemons: after a failed close they
        // would keep the JVM running.
        System.exit(status);
    }

    private static String run(Connection connection, String[] call) {
        try {
            DatabaseMetaData meta = connection.getMetaData();
            switch (call[0]) {
                case "query":
                    try (Statement s = connection.createStatement();
                         ResultSet rs = s.executeQuery(call[1])) {
                        return json(rs);
                    }
                case "prepared":
                    try (PreparedStatement ps = connection.prepareStatement(call[1])) {
                        StringBuilder out = new StringBuilder("[");
                        int bound = 0;
                        for (int p = 2; p <= call.length; p++) {
                            if (p < call.length && !call[p].equals("|")) {
                                bind(ps, ++bound, call[p]);
                                continue;
                            }
                            try (ResultSet rs = ps.executeQuery()) {
                                out.append(out.length() > 1 ? ", " : "").append(json(rs));
                            }
                            bound = 0;
                        }
                        return out.append("]").toString();
                    }
                case "update":
                    try (Statement s = connection.createStatement()) {
                        return "{\"updated\": " + s.executeUpdate(call[1]) + "}";
                    }
                case "prepared-update":
                    try (PreparedStatement ps = connection.prepareStatement(call[1])) {
                        for (int p = 2; p < call.length; p++) {
                            bind(ps, p - 1, call[p]);
                        }
                        return "{\"updated\": " + ps.executeUpdate() + "}";
                    }
                case "tables":
                    return json(meta.getTables(null, null, "%", null));
                case "columns":
                    return json(meta.getColumns(null, null, call[1], "%"));
                case "primary-keys":
                    return json(meta.getPrimaryKeys(null, null, call[1]));
                case "imported-keys":
                    return json(meta.getImportedKeys(null, null, call[1]));
                case "exported-keys":
                    return json(meta.getExportedKeys(null, null, call[1]));
                case "type-info":
                    return json(meta.getTypeInfo());
                default:
                    return "{\"error\": " + quote("unknown call " + call[0]) + "}";
            }
        } catch (SQLException | RuntimeException e) {
            Throwable root = e;
            while (root.getCause() != null && root.getCause() != root) {
                root = root.getCause();
            }
            return "{\"error\": " + quote(e.getMessage() + (root == e ? "" : " (" + root + ")")) + "}";
        }
    }

    private static void bind(PreparedStatement ps, int index, String typed) throws SQLException {
        String type = typed.substring(0, typed.indexOf(':'));
        String value = typed.substring(typed.indexOf(':') + 1);
        switch (type) {
            case "int" -> ps.setInt(index, Integer.parseInt(value));
            case "long" -> ps.setLong(index, Long.parseLong(value));
            case "double" -> ps.setDouble(index, Double.parseDouble(value));
            case "string" -> ps.setString(index, value);
            case "decimal" -> ps.setBigDecimal(index, new java.math.BigDecimal(value));
            case "bool" -> ps.setBoolean(index, Boolean.parseBoolean(value));
            case "date" -> ps.setDate(index, java.sql.Date.valueOf(value));
            case "timestamp" -> ps.setTimestamp(index, java.sql.Timestamp.valueOf(value));
            case "time" -> ps.setTime(index, java.sql.Time.valueOf(value));
            default -> throw new IllegalArgumentException("unknown parameter type " + type);
        }
    }

    private static String json(ResultSet rs) throws SQLException {
        try (rs) {
            ResultSetMetaData m = rs.getMetaData();
            StringBuilder out = new StringBuilder("{\"columns\": [");
            for (int c = 1; c <= m.getColumnCount(); c++) {
                out.append(c > 1 ? ", " : "").append("[").append(quote(m.getColumnName(c)))
                        .append(", ").append(quote(m.getColumnTypeName(c))).append("]");
            }
            out.append("], \"rows\": [");
            boolean first = true;
            while (rs.next()) {
                out.append(first ? "[" : ", [");
                first = false;
                for (int c = 1; c <= m.getColumnCount(); c++) {
                    Object v = rs.getObject(c);
                    String text = v instanceof byte[] bytes ? java.util.HexFormat.of().formatHex(bytes) : String.valueOf(v);
                    out.append(c > 1 ? ", " : "").append(v == null ? "null" : quote(text));
                }
                out.append("]");
            }
            return out.append("]}").toString();
        }
    }

    private static String quote(String s) {
        StringBuilder out = new StringBuilder("\"");
        for (char ch : String.valueOf(s).toCharArray()) {
            switch (ch) {
                case '"' -> out.append("\\\"");
                case '\\' -> out.append("\\\\");
                case '\n' -> out.append("\\n");
                case '\r' -> out.append("\\r");
                case '\t' -> out.append("\\t");
                default -> {
                    if (ch < 0x20) {
                        out.append(String.format("\\u%04x", (int) ch));
                    } else {
                        out.append(ch);
                    }
                }
            }
        }
        return out.append('"').toString();
    }
}
